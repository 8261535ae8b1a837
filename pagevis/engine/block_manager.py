"""One layer's frames when many sequences share them: reference counts, an LRU free queue, prefix hashes.

A frame's reference count is the number of block-table entries (over all sequences) that point at it.
At zero the frame joins the free queue. A full page that was registered under a prefix hash keeps its
K/V and its hash while it waits in the queue, so a later sequence with the same prefix can take it
back (vLLM's automatic prefix caching). Frames that hold nothing reusable sit at the head of the queue
and are handed out first; hashed ones join the tail in the order they were freed, so when the pool must
reuse a cached page it takes the least recently freed one (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class BlockManager:
    def __init__(self, n_frames: int):
        self.n_frames = n_frames
        self.ref_counts = np.zeros(n_frames, dtype=np.int32)
        self.free_queue: OrderedDict[int, None] = OrderedDict((frame, None) for frame in range(n_frames))
        self.frame_hash: dict[int, int] = {}
        self.hash_frame: dict[int, int] = {}

    # --- questions -------------------------------------------------------------------------------
    def n_free(self) -> int:
        """Frames that can be handed out now (cached ones included: they are reclaimable)."""
        return len(self.free_queue)

    def n_used(self) -> int:
        return self.n_frames - len(self.free_queue)

    def is_shared(self, frame: int) -> bool:
        return self.ref_counts[frame] > 1

    def cached_free(self) -> list[int]:
        """Free frames still holding a hashed page, in the order the pool will reuse them."""
        return [frame for frame in self.free_queue if frame in self.frame_hash]

    def lookup(self, page_hash: int) -> int | None:
        return self.hash_frame.get(page_hash)

    # --- changes ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """The head of the free queue, with a reference count of 1 (its cached hash, if any, is dropped)."""
        if not self.free_queue:
            raise RuntimeError("no free frame; preempt or evict first")
        frame, _ = self.free_queue.popitem(last=False)
        self.forget(frame)
        self.ref_counts[frame] = 1
        return frame

    def share(self, frame: int) -> None:
        """One more block-table entry points at frame; a cached free frame comes back into use."""
        if self.ref_counts[frame] == 0:
            if frame not in self.frame_hash:
                raise RuntimeError(f"frame {frame} is free and holds no cached page")
            del self.free_queue[frame]
        self.ref_counts[frame] += 1

    def release(self, frame: int) -> bool:
        """Drop one reference; True when the frame became free."""
        if self.ref_counts[frame] < 1:
            raise RuntimeError(f"frame {frame} is already free")
        self.ref_counts[frame] -= 1
        if self.ref_counts[frame]:
            return False
        self.free_queue[frame] = None
        if frame not in self.frame_hash:
            self.free_queue.move_to_end(frame, last=False)
        return True

    def register(self, frame: int, page_hash: int) -> None:
        """Frame holds the full page with this hash (the first frame registered for a hash keeps it)."""
        if page_hash in self.hash_frame or frame in self.frame_hash:
            return
        self.frame_hash[frame] = page_hash
        self.hash_frame[page_hash] = frame

    def forget(self, frame: int) -> None:
        """Frame's contents are about to change: it no longer stands for its hash."""
        page_hash = self.frame_hash.pop(frame, None)
        if page_hash is not None:
            del self.hash_frame[page_hash]

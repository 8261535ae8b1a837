"""The one allocator: frames of one storage tier of one layer, their reference counts and the prefix cache.

vLLM v1's BlockPool and nano-vllm's BlockManager in one small class. A frame's reference count is the
number of block-table entries (over all sequences) that point at it; at zero the frame is free. Free
frames come out in this order:

1. empty frames, lowest id first (a heap): the used part of the RAM pool stays a compact prefix that
   attention of a single owner reads as one view, with no gather;
2. then cached frames, least recently freed first (LRU): a full page registered under its prefix hash
   keeps its K/V and its hash while it is free, so a later sequence with the same prefix can take it back
   (`share`), until the pool needs the frame for something else (vLLM's automatic prefix caching).

The same class serves RAM frames, the disk tier's page ids, and the disk tier's home frames.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np


class BlockPool:
    # how many times any pool's frames in use grew (or a pool was reset): a caller that noted its pools' peak
    # (store.note_peak) when this stood where it stands now need not note it again (KVCacheManager.commit)
    grown = 0

    def __init__(self, n_frames: int):
        self.n_frames = n_frames
        self.ref_counts = np.zeros(n_frames, dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        BlockPool.grown += 1
        self.ref_counts.fill(0)
        self.empty = list(range(self.n_frames))  # a heap of free frames holding nothing reusable
        self.cached: OrderedDict[int, None] = OrderedDict()  # free frames holding a hashed page, LRU first
        self.frame_hash: dict[int, int] = {}
        self.hash_frame: dict[int, int] = {}

    # --- questions -------------------------------------------------------------------------------
    def n_free(self) -> int:
        """Frames that can be handed out now (cached ones included: they are reclaimable)."""
        return len(self.empty) + len(self.cached)

    def n_used(self) -> int:
        return self.n_frames - self.n_free()

    def can_allocate(self, n: int = 1) -> bool:
        return self.n_free() >= n

    def is_shared(self, frame: int) -> bool:
        return self.ref_counts[frame] > 1

    def cached_free(self) -> list[int]:
        """Free frames still holding a hashed page, in the order the pool will reuse them."""
        return list(self.cached)

    def lookup(self, page_hash: int) -> int | None:
        return self.hash_frame.get(page_hash)

    def peek_free(self, n: int) -> list[int]:
        """The n frames `allocate` would hand out next, in order (fewer if fewer are free)."""
        first = heapq.nsmallest(n, self.empty)
        return first + list(self.cached)[: n - len(first)]

    def high_water(self) -> int:
        """1 + the highest frame in use (0 when none is)."""
        used = np.flatnonzero(self.ref_counts)
        return int(used[-1]) + 1 if used.size else 0

    # --- changes ---------------------------------------------------------------------------------
    def allocate(self) -> tuple[int, int | None]:
        """A free frame with a reference count of 1, and the hash it held if it was a cached page (the
        page is gone from the prefix cache now)."""
        if self.empty:
            frame = heapq.heappop(self.empty)
        elif self.cached:
            frame, _ = self.cached.popitem(last=False)
        else:
            raise RuntimeError("no free frame; preempt or evict first")
        BlockPool.grown += 1
        self.ref_counts[frame] = 1
        return frame, self.forget(frame)

    def share(self, frame: int) -> None:
        """One more block-table entry points at frame; a cached free frame comes back into use."""
        if self.ref_counts[frame] == 0:
            if frame not in self.cached:
                raise RuntimeError(f"frame {frame} is free and holds no cached page")
            del self.cached[frame]
            BlockPool.grown += 1
        self.ref_counts[frame] += 1

    def release(self, frame: int) -> bool:
        """Drop one reference; True when the frame became free."""
        if self.ref_counts[frame] < 1:
            raise RuntimeError(f"frame {frame} is already free")
        self.ref_counts[frame] -= 1
        if self.ref_counts[frame]:
            return False
        if frame in self.frame_hash:
            self.cached[frame] = None
        else:
            heapq.heappush(self.empty, frame)
        return True

    def register(self, frame: int, page_hash: int) -> bool:
        """Frame holds the full page with this hash; True if it now stands for it (the first frame
        registered for a hash keeps it)."""
        if page_hash in self.hash_frame or frame in self.frame_hash:
            return False
        self.frame_hash[frame] = page_hash
        self.hash_frame[page_hash] = frame
        return True

    def forget(self, frame: int) -> int | None:
        """Frame's contents are about to change: it no longer stands for its hash (returned, if any).
        A forgotten free frame moves from the cached queue to the empty ones."""
        page_hash = self.frame_hash.pop(frame, None)
        if page_hash is None:
            return None
        del self.hash_frame[page_hash]
        if frame in self.cached:
            del self.cached[frame]
            heapq.heappush(self.empty, frame)
        return page_hash

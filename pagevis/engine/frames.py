"""Frames of one storage tier: which are free, and how many block-table entries use each.

nano-vllm's block manager in miniature: a frame is free when its reference count is 0. Free frames
come out lowest id first (a heap), which keeps the used part of the RAM pool a compact prefix that
attention reads as one view. Today one sequence uses each frame at most once (count 0 or 1);
`share` is there for sequences that will share a prefix.
"""

from __future__ import annotations

import heapq

import numpy as np


class FramePool:
    def __init__(self, n_frames: int):
        self.n_frames = n_frames
        self.ref_counts = np.zeros(n_frames, dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        self.ref_counts.fill(0)
        self.free = list(range(self.n_frames))  # a heap

    def can_allocate(self, n: int = 1) -> bool:
        return len(self.free) >= n

    def n_free(self) -> int:
        return len(self.free)

    def peek_free(self, n: int) -> list[int]:
        """The n frames `allocate` would hand out next, in order (fewer if fewer are free)."""
        return heapq.nsmallest(n, self.free)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("no free frame; evict first")
        frame = heapq.heappop(self.free)
        self.ref_counts[frame] = 1
        return frame

    def share(self, frame: int) -> None:
        if self.ref_counts[frame] < 1:
            raise RuntimeError(f"frame {frame} is free; allocate it before sharing")
        self.ref_counts[frame] += 1

    def release(self, frame: int) -> bool:
        """Drop one reference; True when the frame became free."""
        if self.ref_counts[frame] < 1:
            raise RuntimeError(f"frame {frame} is already free")
        self.ref_counts[frame] -= 1
        if self.ref_counts[frame]:
            return False
        heapq.heappush(self.free, frame)
        return True

    def high_water(self) -> int:
        """1 + the highest frame in use (0 when none is)."""
        used = np.flatnonzero(self.ref_counts)
        return int(used[-1]) + 1 if used.size else 0

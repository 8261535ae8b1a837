"""One layer's page store: the K/V frames, which token sits in which slot, and which pages are in use.

RAM storage is laid out (n_kv_heads, frames, page_size, head_dim) rather than pages-first, so that for
each KV head the pool is one contiguous matrix: attention runs on a view of the pool's used prefix with
no gather and no copy (see attention.py). A page id names a page for its whole life; a "flat slot" is
page * page_size + slot, the index every per-token array (positions, policy statistics) uses. With RAM
only, page id and RAM frame are the same number.
"""

from __future__ import annotations

import numpy as np

from .frames import FramePool


class PageStore:
    def __init__(self, config, layer: int):
        self.layer = layer
        self.page_size = config.page_size
        self.n_pages = config.max_pages
        shape = (config.n_kv_heads, config.max_pages, config.page_size, config.head_dim)
        self.k = np.zeros(shape, dtype=config.dtype)
        self.v = np.zeros(shape, dtype=config.dtype)
        self.frames = FramePool(config.max_pages)
        n_slots = self.n_pages * self.page_size
        self.positions = np.full(n_slots, -1, dtype=np.int64)  # flat slot -> token position, -1 empty
        self.bias = np.full(n_slots, -np.inf, dtype=np.float32)  # 0 where resident: the occupancy mask
        self.fill = np.zeros(self.n_pages, dtype=np.int64)  # resident tokens per page
        self.reset()

    def reset(self) -> None:
        self.frames.reset()
        self.positions.fill(-1)
        self.bias.fill(-np.inf)
        self.fill.fill(0)
        self.holes: set[int] = set()  # empty flat slots inside allocated pages
        self.high_water = 0  # 1 + highest allocated frame: attention reads frames [0, high_water)

    # --- questions -------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.n_pages * self.page_size

    @property
    def resident(self) -> int:
        return int(self.fill.sum())

    def free_slots(self) -> int:
        return len(self.holes) + self.frames.n_free() * self.page_size

    def occupied(self) -> np.ndarray:
        return self.positions >= 0

    def slot_map(self) -> np.ndarray:
        """(frames, page_size) token position per RAM slot, -1 where empty (a live view)."""
        return self.positions.reshape(self.n_pages, self.page_size)

    # --- changes ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A free page (the lowest id); its slots become holes to fill."""
        page = self.frames.allocate()
        self.high_water = max(self.high_water, page + 1)
        start = page * self.page_size
        self.holes.update(range(start, start + self.page_size))
        return page

    def take_hole(self) -> int:
        """The lowest empty flat slot of an allocated page (allocate one first if there is none)."""
        flat = min(self.holes)
        self.holes.remove(flat)
        return flat

    def write(self, flat: int, k: np.ndarray, v: np.ndarray, position: int) -> None:
        page, slot = divmod(flat, self.page_size)
        self.k[:, page, slot] = k
        self.v[:, page, slot] = v
        self.positions[flat] = position
        self.bias[flat] = 0.0
        self.fill[page] += 1

    def remove(self, flat: int) -> int:
        """Take the token out of a slot (its K/V stays, masked); return its position."""
        position = int(self.positions[flat])
        if position < 0:
            raise RuntimeError(f"evict of empty slot {flat} in layer {self.layer}")
        self.positions[flat] = -1
        self.bias[flat] = -np.inf
        self.fill[flat // self.page_size] -= 1
        self.holes.add(flat)
        return position

    def release(self, page: int) -> None:
        """An empty page goes back to the free list."""
        start = page * self.page_size
        self.holes.difference_update(range(start, start + self.page_size))
        self.frames.release(page)
        self.high_water = self.frames.high_water()

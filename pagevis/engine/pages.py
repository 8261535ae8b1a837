"""One layer's page pool: preallocated K/V storage, free list, block table and slot map.

Storage is laid out (n_kv_heads, max_pages, page_size, head_dim) rather than pages-first, so that for
each KV head the pool is one contiguous matrix: attention runs on a view of the pool's allocated
prefix with no gather and no copy (see attention.py). A "flat slot" is page * page_size + slot.
"""

from __future__ import annotations

import heapq

import numpy as np

from .config import CacheConfig
from .events import CacheEvent, EventKind


class LayerPages:
    def __init__(self, config: CacheConfig, layer: int):
        self.layer = layer
        self.page_size = config.page_size
        self.max_pages = config.max_pages
        shape = (config.n_kv_heads, config.max_pages, config.page_size, config.head_dim)
        self.k = np.zeros(shape, dtype=config.dtype)
        self.v = np.zeros(shape, dtype=config.dtype)
        n_slots = config.capacity
        self.positions = np.full(n_slots, -1, dtype=np.int64)  # flat slot -> token position, -1 empty
        self.bias = np.full(n_slots, -np.inf, dtype=np.float32)  # 0 where resident: the occupancy mask
        self.accumulated = np.zeros(n_slots, dtype=np.float64)  # attention summed over steps (H2O)
        self.last = np.zeros(n_slots, dtype=np.float64)  # attention at the latest step (TOVA)
        self.reset()

    def reset(self) -> None:
        self.positions.fill(-1)
        self.bias.fill(-np.inf)
        self.accumulated.fill(0.0)
        self.last.fill(0.0)
        self.fill = np.zeros(self.max_pages, dtype=np.int64)  # resident tokens per page
        self.free_pages = list(range(self.max_pages))  # a heap: low page ids first keep the pool compact
        self.block_table: list[int] = []  # logical page order -> physical page id
        self.holes: set[int] = set()  # empty flat slots inside allocated pages
        self.high_water = 0  # 1 + highest allocated physical page id

    # --- questions -------------------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return int(self.fill.sum())

    def free_slots(self) -> int:
        return len(self.holes) + len(self.free_pages) * self.page_size

    def occupied(self) -> np.ndarray:
        return self.positions >= 0

    def slot_map(self) -> np.ndarray:
        """(max_pages, page_size) token position per physical slot, -1 where empty (a copy)."""
        return self.positions.reshape(self.max_pages, self.page_size).copy()

    # --- changes ---------------------------------------------------------------------------------
    def take_slot(self, step: int, events: list[CacheEvent]) -> int:
        """Return an empty flat slot, allocating a free page if no allocated page has a hole."""
        if not self.holes:
            if not self.free_pages:
                raise RuntimeError("take_slot called with no free slot; evict first")
            page = heapq.heappop(self.free_pages)
            self.block_table.append(page)
            self.high_water = max(self.high_water, page + 1)
            start = page * self.page_size
            self.holes.update(range(start, start + self.page_size))
            events.append(CacheEvent(EventKind.ALLOCATE, step, self.layer, page, -1, -1))
        flat = min(self.holes)
        self.holes.remove(flat)
        return flat

    def write(self, flat: int, k: np.ndarray, v: np.ndarray, position: int, step: int,
              events: list[CacheEvent]) -> None:
        page, slot = divmod(flat, self.page_size)
        self.k[:, page, slot] = k
        self.v[:, page, slot] = v
        self.positions[flat] = position
        self.bias[flat] = 0.0
        self.accumulated[flat] = 0.0
        self.last[flat] = 0.0
        self.fill[page] += 1
        events.append(CacheEvent(EventKind.WRITE, step, self.layer, page, slot, position))

    def evict(self, flat: int, step: int, policy: str, reason: str, score: float,
              events: list[CacheEvent]) -> None:
        page, slot = divmod(flat, self.page_size)
        position = int(self.positions[flat])
        if position < 0:
            raise RuntimeError(f"evict of empty slot {flat} in layer {self.layer}")
        events.append(CacheEvent(EventKind.EVICT, step, self.layer, page, slot, position,
                                 policy, reason, float(score)))
        self.positions[flat] = -1
        self.bias[flat] = -np.inf
        self.fill[page] -= 1
        self.holes.add(flat)
        if self.fill[page] == 0:
            self._release(page, step, events)

    def _release(self, page: int, step: int, events: list[CacheEvent]) -> None:
        start = page * self.page_size
        self.holes.difference_update(range(start, start + self.page_size))
        self.block_table.remove(page)
        heapq.heappush(self.free_pages, page)
        self.high_water = max(self.block_table) + 1 if self.block_table else 0
        events.append(CacheEvent(EventKind.RELEASE, step, self.layer, page, -1, -1))

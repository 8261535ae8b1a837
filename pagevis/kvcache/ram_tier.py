"""A store's tier: the RAM frames' side of its pages. Every PageStore holds one (`store.tier`): `RamTier` here when
the layer has no swap file, `DiskTier` (disk_tier.py) when it has one; the store's frame operations (allocating,
restoring, writing, freeing and copying a page) tell its tier, which keeps, for every RAM frame, the page it holds
(`page_in`; `frame_of`, per page, the frame holding it), each RAM slot's position (`frame_positions`) and its 0/−∞
occupancy bias (`bias`), the frames attention reads (`high_water`) and what moved between tiers (`counts`).

With RAM only, a page id is its RAM frame: `frame_of` and `page_in` are the identity and `frame_positions` is the
store's own positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np

from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.events import EventKind
from pagevis.kvcache.slots import page_slots

MoveListener = Callable[[EventKind, int, int, str], None]  # (kind, page, frame, detail)


@dataclass
class TierCounts:
    """What moved between the tiers of one layer (since the counts were last taken)."""

    hits: int = 0  # pages a query read from RAM
    faults: int = 0  # pages read from disk
    swapped_out: int = 0  # pages that left RAM (written if dirty)
    bytes_read: int = 0
    bytes_written: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


COUNT_NAMES = tuple(f.name for f in fields(TierCounts))


class TierStore(Protocol):
    """What a tier reads of the store that holds it (a PageStore: store.py)."""

    page_size: int
    n_pages: int  # page ids
    n_frames: int  # RAM frames
    home_frames: int  # RAM frames that keep pages between steps (the rest take pages read for one call)
    positions: np.ndarray  # per page id slot: its token's position, -1 empty
    pages: BlockPool  # the page ids

    def frame_blocks(self, frame: int) -> list[np.ndarray]: ...

    def copy_frame(self, src: int, dst: int) -> None: ...


def ignore_move(kind: EventKind, page: int, frame: int, detail: str) -> None:
    """The listener until the cache sets one (its layer manager turns moves into events)."""


class RamTier:
    """Every page in RAM: page id p is RAM frame p."""

    tiered = False

    def __init__(self, store: TierStore):
        self.store = store  # its positions (the frames' too) and its page pool (the high water)
        self.page_size = store.page_size
        self.frame_positions = store.positions  # flat slot -> position, -1 empty: page and frame are one
        self.bias = np.full(store.n_pages * store.page_size, -np.inf, dtype=np.float32)  # per slot: 0 resident
        self.frame_of = self.page_in = np.arange(store.n_pages, dtype=np.int64)
        self.high_water = 0  # 1 + highest used frame: attention reads frames [0, high_water)
        self.counts = TierCounts()
        self.on_move: MoveListener = ignore_move  # never called: nothing moves between tiers

    def reset(self) -> None:
        self.bias.fill(-np.inf)
        self.high_water = 0
        self.counts = TierCounts()

    def take_counts(self) -> TierCounts:
        counts, self.counts = self.counts, TierCounts()
        return counts

    def in_ram(self, pages: np.ndarray) -> np.ndarray:
        return np.ones(len(pages), dtype=bool)

    def take_frame(self, page: int, step: int) -> None:
        """A page was allocated: it is its own frame."""
        self.high_water = max(self.high_water, page + 1)

    def show_restored(self, page: int) -> None:
        """A cached full page is back in use (a prefix hit): its slots are resident."""
        self.bias[page_slots(page, self.page_size)] = 0.0
        self.high_water = max(self.high_water, page + 1)

    def make_resident(self, page: int, step: int) -> None:
        """Nothing to read: the page is in RAM."""

    def hide(self, page: int) -> None:
        """The page's tokens are gone (freed or reclaimed)."""
        self.bias[page_slots(page, self.page_size)] = -np.inf

    def mark_written(self, page: int, frame: int, slot: int, flat: int, position: int) -> None:
        self.bias[flat] = 0.0

    def changed(self, page: int) -> None:
        """The page's K/V changed in RAM: nothing to bring up to date."""

    def free_frames(self, page: int, cached: bool) -> None:
        """The page is free: attention reads up to the highest page still in use (or cached)."""
        self.high_water = self.store.pages.high_water()

    def copy_source(self, src: int, target: int) -> None:
        """Copy-on-write: the source page's frame into the target frame."""
        self.store.copy_frame(int(self.frame_of[src]), target)

    def show_copy(self, src: int, dst: int, target: int, keep: np.ndarray) -> None:
        self.bias[page_slots(dst, self.page_size)] = np.where(keep, self.bias[page_slots(src, self.page_size)],
                                                              -np.inf)

    def frames_showing(self, page: int) -> list[int]:
        return [page]

    def reserve(self, new_pages: int) -> None:
        """Nothing to reserve: RAM frames are allocated with the store."""

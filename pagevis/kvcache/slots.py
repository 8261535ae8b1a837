"""Page ids and flat slots: a flat slot is page * page_size + slot, the index every per-token array of a layer uses
(positions, the occupancy bias, policy statistics, per-head masks). That arithmetic over arrays of pages and slots is
written here; one slot on a hot path (a write's, a merge's) is a product or a divmod where it is used."""

from __future__ import annotations

import numpy as np


def flat_slots(pages, page_size: int) -> np.ndarray:
    """The flat slots of these pages, in order: (n * page_size,) for n pages, (rows, n * page_size) for a (rows, n)
    array of them (a negative page id gives negative slots: no page)."""
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[..., None] * page_size + np.arange(page_size)).reshape(*pages.shape[:-1], -1)


def page_and_slot(flats: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The page and the slot in it of each flat slot."""
    return flats // page_size, flats % page_size


def page_slots(page: int, page_size: int) -> slice:
    """One page's flat slots, as a slice of a per-slot array."""
    return slice(page * page_size, (page + 1) * page_size)

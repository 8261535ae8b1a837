from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy


@dataclass
class OldestPage(EvictionPolicy):
    """When no page is free, free the oldest whole page (the first in the block table)."""

    name = "oldest-page"
    citation = "Page-granular sliding window, as vLLM's block manager frees blocks (Kwon et al. 2023, arXiv:2309.06180)."
    reason = "oldest page"

    def score(self, pages):
        return pages.positions.astype(float)

    def choose_victims(self, pages):
        page = pages.block_table[0]
        start = page * pages.page_size
        slots = np.arange(start, start + pages.page_size)
        slots = slots[pages.positions[slots] >= 0]
        return slots, pages.positions[slots].astype(float)

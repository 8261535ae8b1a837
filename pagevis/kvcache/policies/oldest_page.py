from dataclasses import dataclass

from pagevis.kvcache.policies.base import EvictionPolicy, page_slots


@dataclass
class OldestPage(EvictionPolicy):
    """When no page is free, free the oldest whole page (the first in the block table)."""

    name = "oldest-page"
    citation = "Page-granular sliding window, as vLLM's block manager frees blocks (Kwon et al. 2023, arXiv:2309.06180)."
    reason = "oldest page"

    def score(self, pages):
        return pages.positions.astype(float)

    def choose_victims(self, pages):
        slots = page_slots(pages, pages.block_table[0])
        return slots, pages.positions[slots].astype(float)

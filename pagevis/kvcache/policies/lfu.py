from dataclasses import dataclass

from pagevis.kvcache.policies.base import evict_page, page_values
from pagevis.kvcache.policies.lru import LeastRecentlyUsedPage


@dataclass
class LeastFrequentlyUsedPage(LeastRecentlyUsedPage):
    """Free the whole page used on the fewest steps since it was allocated (ties: the oldest page). The page
    being filled (the newest) is never chosen, or every new page would go first with no uses yet. A page is
    used by a query when it gets at least `threshold_pct` percent of its attention (default: its even share,
    page_size / capacity)."""

    name = "lfu"
    citation = ("Page-level LFU, one of the cache policies LMCache offers for its offloaded KV chunks "
                "(cache_policy=\"LFU\"; the LMCache project, 2024); use = attention above a threshold.")
    reason = "least frequently used page"

    def score(self, pages):
        return page_values(pages, pages.stats.uses)

    def choose_victims(self, pages):
        return evict_page(pages, self.score(pages), pages.block_table[:-1] or pages.block_table)

from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy, evict_page, page_values


class PageUses(PolicyState):
    """When each page was last used and how many queries used it, kept on every slot of the page. A page is
    used by a query when its tokens together get at least `threshold` of that query's attention (mean over
    heads). The clock counts queries, so a prefill chunk counts as its tokens one by one would: the i-th
    token written before an attention call counts as a use at (clock before query i) + 0.5, after the
    uses of the query before it and before its own query's."""

    def __init__(self, n_slots, page_size, threshold):
        super().__init__(n_slots)
        self.page_size, self.threshold = page_size, threshold
        self.last_use = self.add_array("last_use")
        self.uses = self.add_array("uses")
        self.clock = 0
        self.written: list[int] = []  # slots written since the last attention call, in order

    def reset(self):
        super().reset()
        self.clock = 0
        self.written = []

    def clear(self, flat):
        super().clear(flat)
        self.written.append(flat)

    def observe(self, weights, slots):
        mean = weights.mean(axis=1)  # (queries, slots read)
        read = np.arange(self.n_slots)[slots]
        # the slots read need not come in whole pages (the reader returns resident slots only)
        pages, page_of = np.unique(read // self.page_size, return_inverse=True)
        for i, row in enumerate(mean):
            if i < len(self.written):
                self.last_use[self.written[i]] = self.clock + 0.5
            self.clock += 1
            used = np.bincount(page_of, weights=row, minlength=len(pages)) >= self.threshold
            marked = read[used[page_of]]
            self.last_use[marked] = self.clock
            self.uses[marked] += 1
        self.written = []


@dataclass
class LeastRecentlyUsedPage(EvictionPolicy):
    """Free the whole page used least recently. A page is used by a query when it gets at least `threshold_pct`
    percent of that query's attention (default: a page's even share of a full cache, page_size / capacity)."""

    threshold_pct: int | None = None
    uses_attention = True
    name = "lru"
    citation = ("Page-level LRU, as vLLM's evictor and SGLang's radix cache free cached blocks (Kwon et al. 2023, "
                "arXiv:2309.06180; Zheng et al. 2024, arXiv:2312.07104); use = attention above a threshold.")
    reason = "least recently used page"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        if self.threshold_pct is not None:
            self.threshold_pct = self.check_int_param("threshold_pct", self.threshold_pct, 1, 100)
        self.threshold = page_size / capacity if self.threshold_pct is None else self.threshold_pct / 100

    def make_state(self, n_slots):
        return PageUses(n_slots, self.page_size, self.threshold)

    def score(self, pages):
        return page_values(pages, pages.stats.last_use)

    def choose_victims(self, pages):
        return evict_page(pages, self.score(pages), pages.block_table)

from dataclasses import dataclass


from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy, bound, newest


class AccumulatedAttention(PolicyState):
    """Attention each token received, summed over steps and queries (mean over heads)."""

    def __init__(self, n_slots):
        super().__init__(n_slots)
        self.accumulated = self.add_array("accumulated")

    def observe(self, weights, slots):
        n_queries, n_heads, _ = weights.shape
        if n_queries == 1:
            last = weights[-1].sum(axis=0)
            last /= n_heads
            self.accumulated[slots] += last
        else:
            self.accumulated[slots] += weights.sum(axis=(0, 1)) / n_heads


@dataclass
class HeavyHitter(EvictionPolicy):
    """Keep the `recent` most recent tokens; among the rest evict the one with the least attention
    accumulated over all steps so far (mean over heads). Default recent: half the budget."""

    recent: int | None = None
    uses_attention = True
    state_class = AccumulatedAttention
    name = "h2o"
    citation = "H2O: Zhang et al. 2023, Heavy-Hitter Oracle for Efficient Generative Inference, arXiv:2306.14048."
    reason = "lowest accumulated attention"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        if self.recent is None:
            self.recent = capacity // 2
        self.recent = self.check_int_param("recent", self.recent, 0, capacity - 1)

    def score(self, pages):
        return pages.stats.accumulated

    def protected(self, pages):
        return newest(pages, bound(self.recent, "recent"))

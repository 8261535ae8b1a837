from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy, bound, newest
from pagevis.kvcache.policies.lazy_kernels import kernels


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

    def choose_victims(self, pages):
        """The base's choice (the least accumulated attention outside the `recent` newest, ties to the oldest) in one
        numba call (kernels.py), where its ~14 NumPy calls a layer were most of what h2o and merge cost over sinks."""
        kind = type(self)
        if kind.score is not HeavyHitter.score or kind.protected is not HeavyHitter.protected:
            return super().choose_victims(pages)
        victim = kernels().lowest_unprotected(pages.stats.accumulated, pages.positions, bound(self.recent, "recent"))
        if victim < 0:
            raise RuntimeError(f"policy {self.name!r} has no evictable token in layer {pages.layer}")
        return np.array([victim]), pages.stats.accumulated[[victim]]

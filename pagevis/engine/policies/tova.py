from dataclasses import dataclass

from ..policy_state import PolicyState
from .base import EvictionPolicy


class LatestAttention(PolicyState):
    """Attention each token received from the latest query (mean over heads); 0 if it was not read."""

    def __init__(self, n_slots):
        super().__init__(n_slots)
        self.last = self.add_array("last")

    def observe(self, weights, slots):
        n_heads = weights.shape[1]
        last = weights[-1].sum(axis=0)
        last /= n_heads
        self.last.fill(0.0)
        self.last[slots] = last


@dataclass
class Tova(EvictionPolicy):
    """Evict the token with the lowest attention at the latest step (mean over heads)."""

    uses_attention = True
    state_class = LatestAttention
    name = "tova"
    citation = "TOVA: Oren et al. 2024, Transformers are Multi-State RNNs, arXiv:2401.06104."
    reason = "lowest attention at the latest step"

    def score(self, pages):
        return pages.stats.last

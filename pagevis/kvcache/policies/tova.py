from dataclasses import dataclass

from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy


class LatestAttention(PolicyState):
    """Attention each token received from the latest query (mean over heads); 0 if it was not read. With
    n_kv_heads, also per KV head (the mean over its query heads), in `by_head` (n_slots, n_kv_heads)."""

    def __init__(self, n_slots, n_kv_heads=None):
        super().__init__(n_slots)
        self.last = self.add_array("last")
        self.by_head = None if n_kv_heads is None else self.add_array("by_head", width=(n_kv_heads,))

    def observe(self, weights, slots):
        n_heads = weights.shape[1]
        last = weights[-1].sum(axis=0)
        last /= n_heads
        self.last.fill(0.0)
        self.last[slots] = last
        if self.by_head is not None:
            n_kv = self.by_head.shape[1]
            self.by_head.fill(0.0)
            self.by_head[slots] = weights[-1].reshape(n_kv, n_heads // n_kv, -1).mean(axis=1).T


@dataclass
class Tova(EvictionPolicy):
    """Evict the token with the lowest attention at the latest step (mean over heads)."""

    uses_attention = True
    state_class = LatestAttention
    name = "tova"
    citation = "TOVA: Oren et al. 2024, Transformers are Multi-State RNNs, arXiv:2401.06104."
    reason = "lowest attention at the latest step"


    def make_state(self, n_slots):
        return LatestAttention(n_slots, self.n_kv_heads if self.head_stats else None)

    def score(self, pages):
        return pages.stats.last

    def head_scores(self, pages):
        return pages.stats.by_head.T

from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policies.h2o import AccumulatedAttention, HeavyHitter
from pagevis.kvcache.policies.keydiff import unit_keys
from pagevis.kvcache.policies.lazy_kernels import kernels


class AttentionAndKeys(AccumulatedAttention):
    """H2O's accumulated attention, and each token's unit key per KV head (to find its most similar survivor)."""

    def __init__(self, n_slots, n_kv_heads, head_dim):
        super().__init__(n_slots)
        self.unit = self.add_array("unit_keys", np.float32, (n_kv_heads, head_dim))

    def write(self, flat, k, v, position):
        unit_keys(k, self.unit[flat])


@dataclass
class MergeValues(HeavyHitter):
    """H2O's choice of victim (least accumulated attention outside the `recent` newest), but the victim's
    value is not lost: it is folded into the survivor whose key is most like its own (cosine similarity, mean
    over KV heads), weighted by the attention each accumulated — v <- (a_s v + a_e v_e) / (a_s + a_e) in every
    KV head, and the survivor's accumulated attention becomes a_s + a_e. Keys are not merged: a survivor keeps
    its own key (and RoPE position), so what attention finds stays where it was; only what it reads there
    carries the evicted token's value too. The eviction event's `detail` is the survivor's position."""

    merges = True
    name = "merge"
    citation = ("CaM: Zhang et al. 2024, CaM: Cache Merging for Memory-efficient LLMs Inference, ICML 2024 "
                "(values merged, weighted by attention; here into the most similar key, as D2O / KVMerger pick "
                "merge targets: Wan et al. 2024, arXiv:2406.13035; Wang et al. 2024, arXiv:2407.08454).")
    reason = "lowest accumulated attention, value merged"

    def make_state(self, n_slots):
        return AttentionAndKeys(n_slots, self.n_kv_heads, self.head_dim)

    def merge_targets(self, pages, victims):
        # for each victim in turn: the survivor with the largest sum of the KV heads' cosines (the first slot on a
        # tie), its weight, and the survivor's accumulated attention, in one numba call (kernels.py)
        stats = pages.stats
        return kernels().merge_targets(stats.unit, pages.positions, np.ascontiguousarray(victims, dtype=np.int64),
                                       stats.accumulated)

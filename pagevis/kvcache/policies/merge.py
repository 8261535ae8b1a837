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
        self.unit[flat] = unit_keys(k)


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
        stats = pages.stats
        survivors = pages.occupied()
        survivors[victims] = False
        targets, weights = np.zeros(len(victims), dtype=np.int64), np.zeros(len(victims))
        for i, victim in enumerate(victims.tolist()):
            # the largest sum of the KV heads' cosines (the first slot on a tie), in one numba call (kernels.py)
            target = kernels().most_similar(stats.unit, survivors, victim)
            if target < 0:
                return targets - 1, weights
            mass = stats.accumulated[target] + stats.accumulated[victim]
            weights[i] = stats.accumulated[victim] / mass if mass > 0 else 0.5
            stats.accumulated[target] = mass
            targets[i] = target
        return targets, weights

from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy, bound, newest
from pagevis.kvcache.policies.lazy_kernels import kernels


class UnitKeys(PolicyState):
    """Each token's key, per KV head, scaled to unit length (written once, when the token is)."""

    def __init__(self, n_slots, n_kv_heads, head_dim):
        super().__init__(n_slots)
        self.unit = self.add_array("unit_keys", np.float32, (n_kv_heads, head_dim))

    def write(self, flat, k, v, position):
        unit_keys(k, self.unit[flat])


def unit_keys(k: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """k (..., d) scaled to unit length (a zero key stays zero), into `out` if given: np.linalg.norm's arithmetic
    for a real k (the square root of NumPy's sum of squares). A token's float32 keys (each write of keydiff and
    merge) in one numba call that sums as NumPy does (kernels.unit_rows: the same float32 values)."""
    if out is not None and k.ndim == 2 and k.dtype == out.dtype == np.float32:
        kernels().unit_rows(k, out)
        return out
    norm = np.sqrt(np.add.reduce(k * k, axis=-1, keepdims=True))
    return np.divide(k, np.where(norm > 0, norm, 1), out=out)


@dataclass
class KeyDiff(EvictionPolicy):
    """Evict the token whose key is most like the others: per KV head, the anchor is the mean of the unit
    keys the head keeps, and a token's score is minus its key's cosine similarity to that anchor (mean over
    KV heads for one set per layer). It reads keys only, never attention weights, so it works with kernels
    that do not materialise them. As kvpress's KeyDiffPress; the paper evicts block by block, here every
    eviction is scored against the current anchor. The `window` newest tokens are kept: kvpress compresses a
    context once and never evicts the question after it nor the answer, and streaming through a cache the
    newest tokens are that question (docs/policies.md: without them keydiff evicted the tokens the next
    prediction needs most; window 0 is the bare score)."""

    window: int | None = None  # default 8 (half the cache in caches of fewer than 16 tokens)
    name = "keydiff"
    citation = ("KeyDiff: Park et al. 2025, Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
                "in Resource-Constrained Environments, arXiv:2504.15364 (score: -cos(key, mean unit key)).")
    reason = "key most similar to the mean key"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        if self.window is None:
            self.window = min(8, capacity // 2)
        self.window = self.check_int_param("window", self.window, 0, capacity - 1)

    def make_state(self, n_slots):
        return UnitKeys(n_slots, self.n_kv_heads, self.head_dim)

    def protected(self, pages):
        return newest(pages, bound(self.window, "window"))

    def head_scores(self, pages):
        unit = pages.stats.unit  # (n_slots, n_kv, d)
        kept = np.broadcast_to(pages.kept(), (unit.shape[1], unit.shape[0]))  # (n_kv, n_slots)
        scores = np.zeros(kept.shape)
        for head in range(kept.shape[0]):
            rows = np.flatnonzero(kept[head])
            if not len(rows):
                continue
            keys = unit[rows, head].astype(np.float64)
            anchor = keys.mean(axis=0)
            norm = np.linalg.norm(anchor)
            scores[head, rows] = -(keys @ anchor) / (norm if norm > 0 else 1)
        return scores

    def score(self, pages):
        return self.head_scores(pages).mean(axis=0)

    def choose_victims(self, pages):
        """The base's choice by `score` (the lowest outside the window, ties to the oldest), in one numba call
        (kernels.py): the ~20 NumPy calls a layer of `head_scores` and the masks cost 0.7x sinks' rate."""
        if pages.head_keep is not None:
            return super().choose_victims(pages)
        victim, score = kernels().keydiff_choice(pages.stats.unit, pages.positions, bound(self.window, "window"))
        if victim < 0:
            raise RuntimeError(f"policy {self.name!r} has no evictable token in layer {pages.layer}")
        return np.array([victim]), np.array([score])

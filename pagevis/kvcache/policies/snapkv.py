from dataclasses import dataclass

import numpy as np

from pagevis.errors import ConfigError, check_int
from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.base import EvictionPolicy, newest, resident_order
from pagevis.kvcache.policies.lazy_kernels import kernels


class ObservationWindow(PolicyState):
    """The head-mean attention of the last `window` queries on every slot (a ring of rows); with n_kv_heads,
    per KV head instead (the mean over each KV head's query heads: rows (window, n_kv_heads, n_slots))."""

    def __init__(self, n_slots, window, n_kv_heads=None):
        super().__init__(n_slots)
        self.rows = np.zeros((window, n_slots) if n_kv_heads is None else (window, n_kv_heads, n_slots))
        self.next = 0

    def reset(self):
        super().reset()
        self.rows.fill(0.0)
        self.next = 0

    def clear(self, flat):
        super().clear(flat)
        self.rows[..., flat] = 0.0

    def observe(self, weights, slots):
        if (self.rows.ndim == 3 and len(weights) == 1 and weights.dtype == np.float32 and isinstance(slots, slice)
                and slots.step is None and slots.stop - (slots.start or 0) == weights.shape[2]):
            # a decode query over a run of slots, per KV head: one numba call (kernels.py), NumPy's means bit for bit
            kernels().observe_window(self.rows, self.next % len(self.rows), weights, slots.start or 0)
            self.next += 1
            return
        last = weights[-len(self.rows):]
        if self.rows.ndim == 2:
            means = last.mean(axis=1)
        else:  # (queries, n_kv, m): each KV head's group of query heads
            n, n_heads, m = last.shape
            means = last.reshape(n, self.rows.shape[1], n_heads // self.rows.shape[1], m).mean(axis=2)
        for row in means:
            self.rows[self.next % len(self.rows)].fill(0.0)
            self.rows[self.next % len(self.rows)][..., slots] = row
            self.next += 1

    def window_attention(self):
        """Per slot (or per KV head and slot), the attention of the window's queries."""
        return self.rows.sum(axis=0)


@dataclass
class SnapKV(EvictionPolicy):
    """Keep the `window` newest tokens (the observation window); evict the token the window's queries attend
    to least, after max-pooling that attention over `kernel` neighbouring tokens (so a token next to
    important ones stays with them; kernel 1: no pooling). SnapKV scores once, at the end of the prompt; here every eviction is scored by the
    latest window, so a text longer than the cache can stream through it. Mean over heads: one set per layer."""

    window: int = 8
    kernel: int = 7
    uses_attention = True
    name = "snapkv"
    citation = ("SnapKV: Li et al. 2024, LLM Knows What You are Looking for Before Generation, arXiv:2404.14469 "
                "(window 8, kernel 7, max pooling as in KVCache-Factory's runs).")
    reason = "lowest pooled attention from the observation window"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.window = self.check_int_param("window", self.window, 1, capacity - 1)
        self.kernel = check_int(f"{self.name}.kernel", self.kernel, 1, 1023)  # wider than the cache is harmless
        if self.kernel % 2 == 0:
            raise ConfigError(f"{self.name}.kernel", self.kernel, "an odd number (pooling centred on each token)")


    def make_state(self, n_slots):
        return ObservationWindow(n_slots, self.window, self.n_kv_heads if self.head_stats else None)

    def score(self, pages):
        return self._pooled(pages, pages.stats.window_attention()[None, :])[0]

    def head_scores(self, pages):
        """Per KV head: its query heads' window attention, max-pooled over the resident tokens (one numba call,
        kernels.py: the same float64 values as `_pooled` over `window_attention`)."""
        return kernels().snapkv_head_scores(pages.stats.rows, pages.positions, self.kernel)

    def choose_victims(self, pages):
        """The base's choice (the lowest score outside the window, ties to the oldest token) with the resident
        tokens sorted once, for both the window and the pooling: most of what this policy costs beside sinks was
        sorting and masking the same slots twice."""
        order = resident_order(pages)
        older = len(order) - self.window
        if older <= 0:
            raise RuntimeError(f"policy {self.name!r} has no evictable token in layer {pages.layer}")
        pooled = self._pool(pages.stats.window_attention()[None, order])[0]
        first = int(np.argmin(pooled[:older]))  # the first lowest: the oldest of a tie
        return order[[first]], pooled[[first]]

    def _pooled(self, pages, attention):
        """(rows, n_slots) attention max-pooled over `kernel` neighbouring resident tokens (position order)."""
        order = resident_order(pages)
        scores = np.zeros(attention.shape)
        scores[:, order] = self._pool(attention[:, order])
        return scores

    def _pool(self, ordered):
        """Rows of attention in position order, max-pooled over `kernel` neighbours (ends clipped): 2 * half maxima
        of shifted copies, a few calls where np.pad and a sliding window view took most of the policy's time."""
        pooled = ordered.copy()
        for shift in range(1, min(self.kernel // 2, ordered.shape[1] - 1) + 1):
            np.maximum(pooled[:, shift:], ordered[:, :-shift], out=pooled[:, shift:])
            np.maximum(pooled[:, :-shift], ordered[:, shift:], out=pooled[:, :-shift])
        return pooled

    def protected(self, pages):
        return newest(pages, self.window)

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pagevis.kvcache.policies.base import EvictionPolicy, bound
from pagevis.kvcache.policies.snapkv import SnapKV
from pagevis.kvcache.policies.lazy_kernels import kernels


@dataclass
class AdaKV(EvictionPolicy):
    """One budget per layer shared by its KV heads: the layer holds at most n_kv_heads x `budget` (KV head,
    token) entries, and before each token is written the entries with the lowest scores of the wrapped
    policy (SnapKV's per KV head by default) go, whichever heads they belong to — a head whose tokens
    matter keeps more of them. Each head's `safeguard_pct` percent of `budget` best entries and the wrapped
    policy's protected tokens (SnapKV's window) go only when nothing else can (then safeguarded entries
    before protected ones, as kvpress's max scores do): the budget holds. A slot is freed
    when every head dropped its token; if the pool runs out of slots first (the heads' tokens can spread
    over up to n_kv_heads x budget slots), the token whose best head scores lowest leaves every head.
    Default budget: the pool's tokens / n_kv_heads, so the heads' tokens always fit it."""

    budget: int | None = None
    safeguard_pct: int = 20
    per_head = True
    scorer: ClassVar[type[EvictionPolicy]] = SnapKV
    name = "adakv"
    citation = ("AdaKV: Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for "
                "Efficient LLM Inference, arXiv:2407.11550 (over SnapKV; kvpress's safeguard alpha 0.20).")
    reason = "lowest score among all KV heads' entries"

    def wrap(self, inner: EvictionPolicy) -> "AdaKV":
        """Score with this policy instead of a fresh `scorer` (before bind; it must score per KV head)."""
        self.inner = inner
        return self

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        if not hasattr(self, "inner"):
            self.inner = self.scorer()
        self.inner.bind(capacity, page_size)
        self.inner.head_stats = True
        self.uses_attention = self.inner.uses_attention  # type: ignore[misc]  # AdaKV needs what its scorer needs
        self.uses_queries = self.inner.uses_queries  # type: ignore[misc]
        self.safeguard_pct = self.check_int_param("safeguard_pct", self.safeguard_pct, 0, 100)

    def bind_layers(self, n_layers):
        super().bind_layers(n_layers)
        self.inner.bind_layers(n_layers)

    def bind_heads(self, n_heads, n_kv_heads, head_dim, rope_base):
        super().bind_heads(n_heads, n_kv_heads, head_dim, rope_base)
        self.inner.bind_heads(n_heads, n_kv_heads, head_dim, rope_base)
        if self.budget is None:
            self.budget = max(1, self.capacity // n_kv_heads)
        self.budget = self.check_int_param("budget", self.budget, 1, self.capacity)
        self.n_safe = self.budget * self.safeguard_pct // 100

    def pool_tokens(self):
        """Slots the heads' tokens may spread over: n_kv_heads x budget (each head keeping other tokens)."""
        return self.n_kv_heads * bound(self.budget, "budget")

    def make_state(self, n_slots):
        return self.inner.make_state(n_slots)

    def reset(self):
        self.inner.reset()

    def head_scores(self, pages):
        return self.inner.head_scores(pages)

    def protected(self, pages):
        return self.inner.protected(pages)

    def score(self, pages):
        """A token's best score over the heads that keep it (what a whole-token eviction goes by)."""
        return np.where(pages.kept(), self.head_scores(pages), -np.inf).max(axis=0)

    def head_room(self, pages):
        entries = kernels().kept_entries(pages.head_keep, pages.positions) if pages.head_keep is not None else int(
            pages.kept().sum())
        return (self.n_kv_heads * bound(self.budget, "budget") - entries) // self.n_kv_heads

    def choose_head_victims(self, pages):
        inner = self._snapkv()
        if inner is not None and pages.head_keep is not None:
            # SnapKV's scores (the default): the kept entries, the scores, the window and the drops in one numba
            # call (kernels.py), where ~10 NumPy calls and 3 kernels a layer and step cost most of adakv's choice
            return kernels().adakv_snapkv_drops(pages.stats.rows, pages.positions, pages.head_keep, inner.window,
                                                inner.kernel, self.n_safe, self.budget)
        kept = pages.kept()
        n_kv = kept.shape[0]
        need = int(kept.sum()) + n_kv - n_kv * self.budget
        if need <= 0:
            return super().choose_head_victims(pages)
        scores = self.head_scores(pages)
        # the budget is kept: entries go in tiers, the plain ones first, then each head's n_safe best (ties: the
        # newest), then protected; within a tier the lowest score first (ties: the oldest token, then the lowest
        # head). One numba call (kernels.py) where a lexsort per head and one over every entry cost 0.65x sinks
        protected = np.ascontiguousarray(self.protected(pages))
        heads, slots = kernels().adakv_drops(np.ascontiguousarray(scores, dtype=np.float64),
                                             np.ascontiguousarray(kept), pages.positions, protected, self.n_safe, need)
        return heads, slots, scores[heads, slots]

    def _snapkv(self) -> SnapKV | None:
        """The wrapped policy if it scores and protects as SnapKV does (SnapKV, PyramidKV), per KV head."""
        inner, kind = self.inner, type(self.inner)
        if (isinstance(inner, SnapKV) and kind.head_scores is SnapKV.head_scores and kind.protected is SnapKV.protected
                and inner.head_stats):
            return inner
        return None

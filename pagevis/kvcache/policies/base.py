"""What every eviction policy shares: a policy scores resident tokens, the lowest unprotected one goes.

A new policy is one small file: a dataclass with its parameters and defaults, a `name`, a one-line
`citation`, and `score()` (higher = keep). Override `protected()` to pin tokens and `choose_victims()`
for policies that do not evict one token at a time. A policy that learns from attention (or from the
keys written, or the queries) names a PolicyState subclass (defined in its own file) as `state_class`;
the cache keeps one per layer and feeds it. Policies read a LayerView: positions, block table and that
state.

Behaviour that composes with any token-level scorer is a wrapper around it (wrappers.py: re-rotation,
periodic compression), not an option here. The cache asks every policy the same questions (`evicted_at_once`,
`after_removal`, `rewrites_survivors`); a wrapper answers for what it adds.

A policy with `per_head` evicts (KV head, token) entries, not tokens: before each token is written the
cache asks it for `choose_head_victims`, masks those entries out of that KV head's attention, and frees
a slot once every KV head dropped its token (`choose_victims` still picks whole tokens when the sequence
needs a slot and none is free). Its LayerView carries the per-head `head_keep` masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pagevis.errors import ConfigError, check_int
from pagevis.kvcache.policy_state import LayerView, PolicyState
from pagevis.kvcache.slots import flat_slots
from pagevis.kvcache.policies.lazy_kernels import kernels


@dataclass
class EvictionPolicy:
    name: ClassVar[str]
    citation: ClassVar[str]
    reason: ClassVar[str] = "lowest score"
    evicts: ClassVar[bool] = True  # False: the cache refuses tokens once full
    uses_attention: ClassVar[bool] = False  # True: the cache feeds every attention call to its state
    uses_queries: ClassVar[bool] = False  # True: the cache feeds every attention call's queries to its state
    per_head: ClassVar[bool] = False  # True: evicts per KV head (see the module docstring)
    prunes: ClassVar[bool] = False  # True: before each write the cache evicts `choose_pruned`, full or not
    merges: ClassVar[bool] = False  # True: an evicted token's value is folded into a survivor (`merge_targets`)
    compresses: ClassVar[bool] = False  # True: compressed once after the prefill (kvzip: `compress`)
    state_class: ClassVar[type[PolicyState]] = PolicyState
    # periodic compression (wrappers.py): the compress_every a policy gets when its settings name none, and
    # whether a burst is one scoring's lowest N (kvpress's DecodingPress) rather than N choices in turn
    default_compress_every: ClassVar[int] = 1
    burst_from_one_scoring: ClassVar[bool] = False
    head_stats = False  # per KV head statistics: AdaKV sets it on the scorer it wraps, before make_state

    @property
    def compressed(self) -> bool:
        """A compressing policy (`compresses`): whether it has compressed its sequence yet."""
        return False

    def context_of(self, n_prompt: int) -> int:
        """A compressing policy: the tokens of a prompt of n_prompt it compresses once they are cached."""
        return n_prompt

    def compress(self, views: list[LayerView]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """A compressing policy's one-shot drops: per layer (KV heads, flat slots, scores)."""
        raise NotImplementedError(f"policy {self.name!r} does not compress")

    def bind(self, capacity: int, page_size: int) -> None:
        """Fix the budget this policy works in; raise ConfigError if its parameters cannot fit."""
        self.capacity = capacity
        self.page_size = page_size

    def bind_layers(self, n_layers: int) -> None:
        """Learn the number of layers (after bind), for policies whose budget differs by layer."""
        self.n_layers = n_layers

    def bind_heads(self, n_heads: int, n_kv_heads: int, head_dim: int, rope_base: float) -> None:
        """Learn the model's head layout (after bind_layers), for policies that score per KV head or
        undo RoPE. Settings checked without a model bind a one-head layout."""
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_base = n_heads, n_kv_heads, head_dim, rope_base

    def layer_capacity(self, layer: int) -> int:
        """Tokens this layer may hold before the policy evicts (the whole pool unless overridden)."""
        return self.capacity

    def pool_tokens(self) -> int:
        """Slots per layer the pool needs for this policy's budget (bound to a large pool): its largest layer."""
        return max(self.layer_capacity(layer) for layer in range(self.n_layers))

    def make_state(self, n_slots: int) -> PolicyState:
        """The per-layer statistics this policy learns from (its `state_class`, unless it needs parameters)."""
        return self.state_class(n_slots)

    def score(self, pages: LayerView) -> np.ndarray:
        """Per flat slot, how much the token there is worth keeping (only resident slots are read)."""
        raise NotImplementedError

    def head_scores(self, pages: LayerView) -> np.ndarray:
        """(n_kv_heads, n_slots): how much each KV head's copy of each token is worth keeping. Scoring
        policies that can score per head override this (AdaKV reads it); the state they learn from must
        then keep per-head statistics (`self.head_stats`, set before `make_state`)."""
        raise NotImplementedError(f"policy {self.name!r} does not score per KV head")

    def head_room(self, pages: LayerView) -> int:
        """Per-head policies: tokens that can be written before the policy must drop an entry on its scores
        (the whole pool unless overridden: a drop by position needs no statistics)."""
        return self.capacity

    def choose_head_victims(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-head policies: the (KV head, flat slot) entries to drop before the next token is written,
        as (heads, slots, scores). A token-level policy drops none."""
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)

    def protected(self, pages: LayerView) -> np.ndarray:
        """Per flat slot, True where the token must not be evicted."""
        return np.zeros(pages.positions.shape, dtype=bool)

    def choose_victims(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray]:
        """Flat slots to evict now and their scores: the unprotected resident token with the lowest
        score, ties broken by the oldest position."""
        candidates = pages.occupied() & ~self.protected(pages)
        if not candidates.any():
            raise RuntimeError(f"policy {self.name!r} has no evictable token in layer {pages.layer}")
        scores = np.where(candidates, self.score(pages), np.inf)
        tied = np.flatnonzero(candidates & (scores == scores.min()))
        victim = tied[np.argmin(pages.positions[tied])]
        return np.array([victim]), scores[[victim]]

    def choose_pruned(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray]:
        """Policies that `prune`: flat slots to evict before the next token is written, whether or not the
        cache is full (a threshold instead of a budget), and their scores."""
        return np.zeros(0, dtype=np.int64), np.zeros(0)

    def prune_room(self, pages: LayerView) -> int:
        """Policies that `prune`: tokens that can be written before the policy may prune on statistics that
        have not seen them (the whole pool unless overridden)."""
        return self.capacity

    def merge_targets(self, pages: LayerView, victims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Policies that `merge`: for each victim about to be evicted, the flat slot of the survivor its value
        is folded into and the victim's weight w in it (v_survivor <- (1 - w) v_survivor + w v_victim)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget any state (random generators) so a reset cache replays identically."""

    # --- what the cache asks every policy (wrappers.py answers for what a wrapper adds) ---------------
    def evicted_at_once(self) -> int:
        """Tokens an eviction takes when the layer is full (its choice, one at a time): 1 unless wrapped."""
        return 1

    def after_removal(self, layer, seq, removed: list[int]) -> None:
        """The tokens at positions `removed` left the sequence's layer (its manager, layer_managers.py): nothing to do
        unless wrapped (re-rotation moves the survivors' keys)."""

    def rewrites_survivors(self) -> bool:
        """Whether an eviction may change tokens that stay (a merged value, a re-rotated key), so that any
        shared page may be copied."""
        return self.merges

    def check_int_param(self, field: str, value: object, low: int, high: int) -> int:
        try:
            return check_int(f"{self.name}.{field}", value, low, high)
        except ConfigError as error:
            raise ConfigError(error.field, value, f"{error.allowed} for a cache of {self.capacity} tokens") from None


def newest(pages: LayerView, n: int) -> np.ndarray:
    """Per flat slot, True on the n newest resident tokens (by position): one numba call (kernels.py), where the
    mask, the sort and the scatter were 5 NumPy calls for every eviction of h2o, snapkv, merge and adakv."""
    return kernels().newest_mask(pages.positions, n)


def resident_order(pages: LayerView) -> np.ndarray:
    """The flat slots holding a token, oldest position first."""
    resident = np.flatnonzero(pages.positions >= 0)
    return resident[np.argsort(pages.positions[resident])]


def page_values(pages: LayerView, per_slot: np.ndarray) -> np.ndarray:
    """Per flat slot, the largest value of `per_slot` over the resident tokens of its page (-inf if none)."""
    grid = np.where(pages.occupied(), per_slot, -np.inf).reshape(-1, pages.page_size)
    return np.repeat(grid.max(axis=1), pages.page_size)


def evict_page(pages: LayerView, scores: np.ndarray, candidates: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """All resident slots of the candidate page with the lowest score (per slot, equal within a page),
    ties broken by the page holding the oldest token."""
    def key(page):
        slots = page_slots(pages, page)
        return scores[slots[0]], pages.positions[slots].min()

    slots = page_slots(pages, min(candidates, key=key))
    return slots, scores[slots]


def page_slots(pages: LayerView, page: int) -> np.ndarray:
    """The flat slots of a page that hold a token."""
    slots = flat_slots(page, pages.page_size)
    return slots[pages.positions[slots] >= 0]


def bound(value: int | None, name: str) -> int:
    """A parameter that defaults to None until the policy's `bind` sets it from the cache's capacity."""
    if value is None:
        raise RuntimeError(f"the policy's {name} is read before the policy is bound to a cache")
    return value

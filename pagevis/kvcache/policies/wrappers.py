"""Behaviour that composes with any token-level scorer, as wrappers around it (kvpress's shape: `KeyRerotationPress`,
`DecodingPress` around a press). `make_policy` wraps a policy when its settings ask (`rerotate=1`,
`compress_every=N`); the cache never asks which wrappers a policy wears, only what the policy does: how many
tokens it evicts at once (`evicted_at_once`), what follows a removal (`after_removal`), whether evicting rewrites
survivors' pages (`rewrites_survivors`).

- `KeyRerotation` (`rerotate=1`, KeyRerotationPress): after each eviction the survivors' RoPE positions are made
  contiguous. The cache keeps every query at its own position and moves each survivor older than an evicted
  token one position later (its key rotated by +1, kvcache/rope_shift.py): every query-key distance is then the
  one contiguous positions give (query at the survivor count, keys at 0, 1, ...), so attention is the same.
- `PeriodicCompression` (`compress_every=N`, DecodingPress): when the cache is full it evicts N tokens at once
  (the policy's choice, N times over; or, for a policy that asks (`burst_from_one_scoring`), the N lowest of one
  scoring, as DecodingPress scores once a compression), down to capacity - N, and refills for N tokens before it
  compresses again. A policy may default to it (`default_compress_every`: expected-attention, as kvpress runs
  ExpectedAttentionPress while decoding).
"""

from __future__ import annotations

import numpy as np

from collections.abc import Callable, Mapping
from typing import ClassVar

from pagevis.errors import ConfigError, check_int
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.policy_state import LayerView, PolicyState
from pagevis.kvcache.rope_shift import inverse_frequencies

# What the cache, the engine and the settings ask of a sequence's policy, wrapped or not (its callers:
# kvcache/eviction.py, admission.py, layer_managers.py, paged_attention.py, snapshot.py, kv_cache_manager.py,
# sequence.py, engine/engine.py, engine/session.py, policies/__init__.py): a wrapper answers these and nothing
# else of EvictionPolicy's, passing each to the policy it wraps unless it adds to it.
POLICY_INTERFACE = (
    # what it is
    "name", "reason", "evicts", "uses_attention", "uses_queries", "per_head", "prunes", "merges", "compresses",
    "capacity", "compressed",
    # binding to a model and a cache
    "bind_layers", "bind_heads", "layer_capacity", "make_state", "reset", "context_of",
    # choosing what goes
    "score", "protected", "choose_victims", "choose_pruned", "prune_room", "head_room", "choose_head_victims",
    "compress", "merge_targets",
    # what the cache asks every policy (a wrapper answers for what it adds)
    "evicted_at_once", "after_removal", "rewrites_survivors",
)


class PolicyWrapper:
    """A policy around another (`inner`: a scorer, or a scorer in wrappers), kvpress's wrapper presses' shape: it
    answers POLICY_INTERFACE, each question passed to `inner` unless the wrapper adds to it, and besides that
    only its options (`rerotate`, `compress_every`: its own or a wrapper's inside it)."""

    option: ClassVar[str]  # the setting this wrapper stands for (WRAPPERS' key)

    def __init__(self, inner: Policy, value: int):
        self.inner = inner
        self._value = value

    # --- its options: its own or a wrapper's inside it (options_of) -------------------------------------
    @property
    def rerotate(self) -> int:
        return options_of(self)["rerotate"]

    @property
    def compress_every(self) -> int:
        return options_of(self)["compress_every"]

    # --- what it is: the wrapped policy's ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def reason(self) -> str:
        return self.inner.reason

    @property
    def evicts(self) -> bool:
        return self.inner.evicts

    @property
    def uses_attention(self) -> bool:
        return self.inner.uses_attention

    @property
    def uses_queries(self) -> bool:
        return self.inner.uses_queries

    @property
    def per_head(self) -> bool:
        return self.inner.per_head

    @property
    def prunes(self) -> bool:
        return self.inner.prunes

    @property
    def merges(self) -> bool:
        return self.inner.merges

    @property
    def compresses(self) -> bool:
        return self.inner.compresses

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def compressed(self) -> bool:
        return self.inner.compressed

    # --- binding ------------------------------------------------------------------------------------------
    def bind_layers(self, n_layers: int) -> None:
        self.inner.bind_layers(n_layers)

    def bind_heads(self, n_heads: int, n_kv_heads: int, head_dim: int, rope_base: float) -> None:
        self.inner.bind_heads(n_heads, n_kv_heads, head_dim, rope_base)

    def layer_capacity(self, layer: int) -> int:
        return self.inner.layer_capacity(layer)

    def make_state(self, n_slots: int) -> PolicyState:
        return self.inner.make_state(n_slots)

    def reset(self) -> None:
        self.inner.reset()

    def context_of(self, n_prompt: int) -> int:
        return self.inner.context_of(n_prompt)

    # --- choosing what goes: the wrapped scorer's choice ---------------------------------------------------
    def score(self, pages: LayerView) -> np.ndarray:
        return self.inner.score(pages)

    def protected(self, pages: LayerView) -> np.ndarray:
        return self.inner.protected(pages)

    def choose_victims(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.choose_victims(pages)

    def choose_pruned(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.choose_pruned(pages)

    def prune_room(self, pages: LayerView) -> int:
        return self.inner.prune_room(pages)

    def head_room(self, pages: LayerView) -> int:
        return self.inner.head_room(pages)

    def choose_head_victims(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.inner.choose_head_victims(pages)

    def compress(self, views: list[LayerView]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return self.inner.compress(views)

    def merge_targets(self, pages: LayerView, victims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.merge_targets(pages, victims)

    # --- what the cache asks every policy: a wrapper overrides what it adds ---------------------------------
    def evicted_at_once(self) -> int:
        return self.inner.evicted_at_once()

    def after_removal(self, layer, seq, removed: list[int]) -> None:
        self.inner.after_removal(layer, seq, removed)

    def rewrites_survivors(self) -> bool:
        return self.inner.rewrites_survivors()


Policy = EvictionPolicy | PolicyWrapper  # what a sequence evicts by: a scorer, or a scorer in wrappers


class KeyRerotation(PolicyWrapper):
    """Survivors' keys re-rotated to contiguous positions after each eviction."""

    option = "rerotate"

    def __init__(self, inner: Policy, rerotate: int = 1):
        super().__init__(inner, rerotate)

    def rewrites_survivors(self) -> bool:
        return True

    def after_removal(self, layer, seq, removed: list[int]) -> None:
        """After the tokens at positions `removed` left: each survivor older than k of them moves k positions
        later (its key rotated by k), so that the distance from any query to it is the one contiguous positions
        would give. The layer's manager rotates them (`rotate_keys`: a shared page is copied and keeps its prefix
        hash, one changed in place no longer stands for its prefix hash)."""
        self.inner.after_removal(layer, seq, removed)
        flat = layer.flat(seq)
        positions = layer.positions_at(flat)
        later = len(removed) - np.searchsorted(np.sort(removed), positions, side="right")
        moving = (positions >= 0) & (later > 0)
        scorer = unwrapped(self.inner)
        layer.rewrites.rotate_keys(seq, flat[moving], later[moving], inverse_frequencies(scorer.head_dim, scorer.rope_base))


class PeriodicCompression(PolicyWrapper):
    """When full, N tokens evicted at once (down to capacity - N)."""

    option = "compress_every"

    def __init__(self, inner: Policy, compress_every: int):
        super().__init__(inner, compress_every)

    def evicted_at_once(self) -> int:
        return self._value  # its own compress_every (read per eviction: no walk through options_of)

    def choose_victims(self, pages: LayerView) -> tuple[np.ndarray, np.ndarray]:
        """A policy that asks: its N lowest-scored unprotected tokens from one scoring (ties: the oldest first), where
        N choices in turn would score N times (the policy's own choice otherwise)."""
        if not unwrapped(self).burst_from_one_scoring:
            return self.inner.choose_victims(pages)
        candidates = np.flatnonzero(pages.occupied() & ~self.inner.protected(pages))
        if not len(candidates):
            raise RuntimeError(f"policy {self.name!r} has no evictable token in layer {pages.layer}")
        scores = self.inner.score(pages)[candidates]
        lowest = np.lexsort((pages.positions[candidates], scores))[:self._value]
        return candidates[lowest], scores[lowest]


# every token policy's options: option -> (its wrapper, the default that means no wrapper); applied in this
# order, the first innermost
WRAPPERS: dict[str, tuple[Callable[[Policy, int], PolicyWrapper], int]] = {"rerotate": (KeyRerotation, 0),
                                                        "compress_every": (PeriodicCompression, 1)}
SHARED_PARAMS = tuple(WRAPPERS)


def check_options(policy: type[EvictionPolicy], options: Mapping[str, object], capacity: int) -> dict[str, int]:
    """The shared options checked for this policy class in a cache of `capacity` tokens: ConfigError for a
    value out of range, or for an option a per-head or never-evicting policy cannot take."""
    name = policy.name
    rerotate = check_int(f"{name}.rerotate", options.get("rerotate", 0), 0, 1)
    # a policy's own default shrinks to fit a small cache; a value given does not
    default = min(option_defaults(policy)["compress_every"], max(1, capacity - 1))
    try:
        every = check_int(f"{name}.compress_every", options.get("compress_every", default), 1, max(1, capacity - 1))
    except ConfigError as error:
        raise ConfigError(error.field, options.get("compress_every"),
                          f"{error.allowed} for a cache of {capacity} tokens") from None
    if (rerotate or every > 1) and (policy.per_head or not policy.evicts):
        option = "rerotate" if rerotate else "compress_every"
        raise ConfigError(f"{name}.{option}", rerotate if rerotate else every,
                          f"the default ({'0' if rerotate else '1'}): {name!r} "
                          f"{'evicts per KV head' if policy.per_head else 'never evicts'}")
    return {"rerotate": rerotate, "compress_every": every}


def option_defaults(policy: type[EvictionPolicy]) -> dict[str, int]:
    """Each wrapper option's value when a policy's settings name none (compress_every: the policy's own default)."""
    return {option: policy.default_compress_every if option == "compress_every" else default
            for option, (_, default) in WRAPPERS.items()}


def wrap(policy: EvictionPolicy, options: dict[str, int]) -> Policy:
    """The policy in the wrappers its (checked) options ask for."""
    wrapped: Policy = policy
    for option, (wrapper, default) in WRAPPERS.items():
        if options[option] != default:
            wrapped = wrapper(wrapped, options[option])
    return wrapped


def options_of(policy: Policy) -> dict[str, int]:
    """Each wrapper option's value on the policy: the wrapper's that sets it (the outermost), else its default."""
    options: dict[str, int] = {}
    while isinstance(policy, PolicyWrapper):
        options.setdefault(policy.option, policy._value)
        policy = policy.inner
    return {option: options.get(option, default) for option, (_, default) in WRAPPERS.items()}


def unwrapped(policy: Policy) -> EvictionPolicy:
    """The scorer inside a policy's wrappers."""
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy

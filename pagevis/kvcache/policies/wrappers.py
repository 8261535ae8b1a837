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
  (the policy's choice, N times over), down to capacity - N, and refills for N tokens before it compresses again.
"""

from __future__ import annotations

import numpy as np

from collections.abc import Callable

from pagevis.errors import ConfigError, check_int
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.rope_shift import inverse_frequencies, rotate


class PolicyWrapper:
    """A policy around another: everything it does not override is the inner policy's (its name, budget,
    scores, statistics)."""

    def __init__(self, inner: EvictionPolicy | PolicyWrapper):
        self.inner = inner

    def __getattr__(self, name: str):
        if name == "inner" or name.startswith("__"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


Policy = EvictionPolicy | PolicyWrapper  # what a sequence evicts by: a scorer, or a scorer in wrappers


class KeyRerotation(PolicyWrapper):
    """Survivors' keys re-rotated to contiguous positions after each eviction."""

    def __init__(self, inner, rerotate: int = 1):
        super().__init__(inner)
        self.rerotate = rerotate

    def rewrites_survivors(self) -> bool:
        return True

    def after_removal(self, layer, seq, removed: list[int]) -> None:
        """After the tokens at positions `removed` left: each survivor older than k of them moves k positions
        later (its key rotated by k), so that the distance from any query to it is the one contiguous positions
        would give. A page it changes comes from `layer.writable`: a shared one is copied (and keeps its prefix
        hash), one changed in place no longer stands for its prefix hash."""
        self.inner.after_removal(layer, seq, removed)
        store, ps = layer.store, layer.page_size
        flat = layer.flat(seq)
        positions = store.positions[flat]
        later = len(removed) - np.searchsorted(np.sort(removed), positions, side="right")
        moving = (positions >= 0) & (later > 0)
        moved, delta = flat[moving], later[moving]
        for page in np.unique(moved // ps).tolist():
            if (copy := layer.writable(seq, page)) != page:
                moved = np.where(moved // ps == page, copy * ps + moved % ps, moved)
        pages, slots = moved // ps, moved % ps
        inv_freq = inverse_frequencies(self.head_dim, self.rope_base)
        rotated = rotate(store.k[:, pages, slots], delta, inv_freq).astype(store.k.dtype)
        if seq.channels is not None:  # ThinK: a RoPE pair with one channel pruned keeps that channel zero
            rotated = seq.channels.prune(layer.layer, rotated.transpose(1, 0, 2)).transpose(1, 0, 2)
        store.k[:, pages, slots] = rotated


class PeriodicCompression(PolicyWrapper):
    """When full, N tokens evicted at once (down to capacity - N)."""

    def __init__(self, inner, compress_every: int):
        super().__init__(inner)
        self.compress_every = compress_every

    def evicted_at_once(self) -> int:
        return self.compress_every


# every token policy's options: option -> (its wrapper, the default that means no wrapper); applied in this
# order, the first innermost
WRAPPERS: dict[str, tuple[Callable[[Policy, int], PolicyWrapper], int]] = {"rerotate": (KeyRerotation, 0),
                                                        "compress_every": (PeriodicCompression, 1)}
SHARED_PARAMS = tuple(WRAPPERS)


def check_options(policy: type[EvictionPolicy], options: dict[str, object], capacity: int) -> dict[str, int]:
    """The shared options checked for this policy class in a cache of `capacity` tokens: ConfigError for a
    value out of range, or for an option a per-head or never-evicting policy cannot take."""
    name = policy.name
    rerotate = check_int(f"{name}.rerotate", options.get("rerotate", 0), 0, 1)
    try:
        every = check_int(f"{name}.compress_every", options.get("compress_every", 1), 1, max(1, capacity - 1))
    except ConfigError as error:
        raise ConfigError(error.field, options.get("compress_every"),
                          f"{error.allowed} for a cache of {capacity} tokens") from None
    if (rerotate or every > 1) and (policy.per_head or not policy.evicts):
        option = "rerotate" if rerotate else "compress_every"
        raise ConfigError(f"{name}.{option}", rerotate if rerotate else every,
                          f"the default ({'0' if rerotate else '1'}): {name!r} "
                          f"{'evicts per KV head' if policy.per_head else 'never evicts'}")
    return {"rerotate": rerotate, "compress_every": every}


def wrap(policy: EvictionPolicy, options: dict[str, int]) -> Policy:
    """The policy in the wrappers its (checked) options ask for."""
    wrapped: Policy = policy
    for option, (wrapper, default) in WRAPPERS.items():
        if options[option] != default:
            wrapped = wrapper(wrapped, options[option])
    return wrapped


def unwrapped(policy) -> EvictionPolicy:
    """The scorer inside a policy's wrappers."""
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy

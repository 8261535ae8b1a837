"""Eviction policies, by name. Adding one: write its file, then list its class here."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pagevis.kvcache.errors import ConfigError
from pagevis.kvcache.policies.adakv import AdaKV
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.policies.duo import DuoAttention
from pagevis.kvcache.policies.expected_attention import ExpectedAttention
from pagevis.kvcache.policies.h2o import HeavyHitter
from pagevis.kvcache.policies.keydiff import KeyDiff
from pagevis.kvcache.policies.kvzip import KVzip
from pagevis.kvcache.policies.lfu import LeastFrequentlyUsedPage
from pagevis.kvcache.policies.lru import LeastRecentlyUsedPage
from pagevis.kvcache.policies.merge import MergeValues
from pagevis.kvcache.policies.none import NoEviction
from pagevis.kvcache.policies.oldest import Oldest
from pagevis.kvcache.policies.oldest_page import OldestPage
from pagevis.kvcache.policies.pyramidkv import PyramidKV
from pagevis.kvcache.policies.random import RandomEviction
from pagevis.kvcache.policies.sinks import Sinks
from pagevis.kvcache.policies.snapkv import SnapKV
from pagevis.kvcache.policies.threshold import Threshold
from pagevis.kvcache.policies.tova import Tova
from pagevis.kvcache.policies.wrappers import (
    SHARED_PARAMS, WRAPPERS, Policy, check_options, option_defaults, options_of, unwrapped, wrap)

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (Oldest, OldestPage, Sinks, HeavyHitter, Tova, SnapKV, PyramidKV,
                              LeastRecentlyUsedPage, LeastFrequentlyUsedPage, RandomEviction, NoEviction,
                              KeyDiff, ExpectedAttention, AdaKV, DuoAttention, Threshold, MergeValues,
                              KVzip)
}


def policy_params(name: str) -> dict[str, object]:
    """The parameters a policy takes and their defaults: its own, then the options every token policy has
    (rerotate, compress_every: the wrappers, wrappers.py)."""
    own = {f.name: f.default for f in dataclasses.fields(POLICIES[name])}
    return {**own, **option_defaults(POLICIES[name])}


def bound_params(policy: Policy) -> dict[str, object]:
    """A bound policy's parameters as `policy_params` lists them (defaults filled in, e.g. h2o's recent window):
    its own, then the options its wrappers set (or their defaults)."""
    inner, options = unwrapped(policy), options_of(policy)
    return {name: options[name] if name in options else getattr(inner, name) for name in policy_params(inner.name)}


@dataclass(frozen=True)
class HeadLayout:
    """The model's shape a policy is bound to: a CacheConfig's, or for settings checked without a model
    (CacheSettings, SessionConfig) one layer of one head of 64 channels at RoPE base 10 000."""

    n_layers: int = 1
    n_heads: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    rope_base: float = 10000.0


class PolicySettings(Protocol):
    """What make_policy reads of a configuration: CacheSettings (and so SessionConfig and CacheConfig) satisfies it;
    mypy checks the match where config.py passes itself (this module cannot import config.py, which imports it)."""

    @property
    def policy(self) -> str: ...
    @property
    def policy_params(self) -> Mapping[str, Any]: ...
    @property
    def capacity(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def float_in_ram(self) -> bool: ...
    @property
    def head_layout(self) -> HeadLayout: ...


def make_policy(config: PolicySettings) -> Policy:
    """Build and bind the policy a CacheConfig (or settings alone, with their one-head layout) names; ConfigError for
    an unknown name or parameter."""
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ConfigError("policy", config.policy, f"one of {', '.join(POLICIES)}")
    known = policy_params(config.policy)
    for key in config.policy_params:
        if key not in known:
            own = [name for name in known if name not in SHARED_PARAMS]
            allowed = f"{', '.join(own) if own else 'no parameters of its own'}, or {', '.join(SHARED_PARAMS)}"
            raise ConfigError(f"{config.policy}.{key}", config.policy_params[key],
                              f"a parameter of {config.policy!r}; it takes {allowed}")
    rewrites = "rerotate" if config.policy_params.get("rerotate") else "policy" if cls.merges else ""
    if rewrites and not config.float_in_ram:
        field = f"{config.policy}.rerotate" if rewrites == "rerotate" else "policy"
        raise ConfigError(field, config.policy_params.get("rerotate", config.policy),
                          f"{'0' if rewrites == 'rerotate' else 'another policy'} with a quantized dtype, a disk tier "
                          "or quest (re-rotating keys and merging values rewrite float K/V in RAM pages; quantized "
                          "codes, pages on disk and Quest's key bounds would go stale)")
    if cls.compresses and not config.float_in_ram:
        raise ConfigError("policy", config.policy, "another policy with a quantized dtype, a disk tier or quest "
                          f"({config.policy}'s reconstruction pass reads float K/V from RAM pages)")
    options = check_options(cls, config.policy_params, config.capacity)
    policy = cls(**{key: value for key, value in config.policy_params.items() if key not in WRAPPERS})
    policy.bind(config.capacity, config.page_size)
    layout = config.head_layout
    policy.bind_layers(layout.n_layers)
    bind_heads(policy, layout)
    return wrap(policy, options)


def bind_heads(policy: EvictionPolicy, layout: HeadLayout) -> None:
    """Tell the policy the model's head layout."""
    policy.bind_heads(layout.n_heads, layout.n_kv_heads, layout.head_dim, layout.rope_base)


def layer_capacities(settings: PolicySettings, n_layers: int, n_heads: int = 1, n_kv_heads: int = 1) -> list[int]:
    """Tokens each layer may hold under these settings' policy (all the pool, except for pyramidkv and duo with
    a budget) for a model of this layout."""
    policy = make_policy(settings)
    policy.bind_layers(n_layers)
    layout = settings.head_layout
    policy.bind_heads(n_heads, n_kv_heads, layout.head_dim, layout.rope_base)
    return [policy.layer_capacity(layer) for layer in range(n_layers)]

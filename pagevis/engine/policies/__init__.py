"""Eviction policies, by name. Adding one: write its file, then list its class here."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .base import EvictionPolicy
from .h2o import HeavyHitter
from .none import NoEviction
from .oldest import Oldest
from .oldest_page import OldestPage
from .random import RandomEviction
from .sinks import Sinks
from .tova import Tova

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (Oldest, OldestPage, Sinks, HeavyHitter, Tova, RandomEviction, NoEviction)
}


def policy_params(name: str) -> dict[str, object]:
    """The parameters a policy takes and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(POLICIES[name])}


def make_policy(config) -> EvictionPolicy:
    """Build and bind the policy a CacheConfig names; ConfigError for an unknown name or parameter."""
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ConfigError("policy", config.policy, f"one of {', '.join(POLICIES)}")
    known = policy_params(config.policy)
    for key in config.policy_params:
        if key not in known:
            allowed = ", ".join(known) if known else "no parameters"
            raise ConfigError(f"{config.policy}.{key}", config.policy_params[key],
                              f"a parameter of {config.policy!r}; it takes {allowed}")
    policy = cls(**config.policy_params)
    policy.bind(config.capacity, config.page_size)
    return policy

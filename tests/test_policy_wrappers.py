"""Re-rotation and periodic compression are wrappers around any scorer (kvcache/policies/wrappers.py): make_policy
wraps a policy when its settings ask, the wrapped policy is still the scorer by name and parameters, and it answers
the cache's questions for what each wrapper adds."""

import copy
import re
from pathlib import Path

import pytest

from pagevis.kvcache import CacheConfig, make_policy
from pagevis.kvcache.policies import bound_params
from pagevis.kvcache.policies.wrappers import (POLICY_INTERFACE, KeyRerotation, PeriodicCompression, PolicyWrapper,
                                               unwrapped)

PAGEVIS = Path(__file__).resolve().parent.parent / "pagevis"

BASE = dict(page_size=4, max_pages=8, n_heads=2, n_kv_heads=1, head_dim=8, policy="sinks")


def test_the_options_wrap_the_scorer_and_the_wrapped_policy_answers_for_them():
    policy = make_policy(CacheConfig(**BASE, policy_params={"rerotate": 1, "compress_every": 3}))
    assert isinstance(policy, PeriodicCompression) and isinstance(policy.inner, KeyRerotation)
    assert policy.name == "sinks" and policy.capacity == 32 and type(unwrapped(policy)).__name__ == "Sinks"
    assert policy.evicted_at_once() == 3 and policy.rewrites_survivors()
    assert bound_params(policy) == {"n_sink": 4, "rerotate": 1, "compress_every": 3}
    forked = copy.deepcopy(policy)  # a fork copies its parent's policy, wrappers and all
    assert forked.evicted_at_once() == 3 and forked.inner.inner is not policy.inner.inner


def test_a_policy_without_options_is_the_bare_scorer():
    policy = make_policy(CacheConfig(**BASE))
    assert not isinstance(policy, PolicyWrapper)
    assert policy.evicted_at_once() == 1 and not policy.rewrites_survivors()
    assert bound_params(policy) == {"n_sink": 4, "rerotate": 0, "compress_every": 1}
    merge = make_policy(CacheConfig(**{**BASE, "policy": "merge"}))
    assert merge.rewrites_survivors()  # a merge folds values into survivors: any shared page may be copied


def test_bound_params_read_each_option_off_the_wrapper_that_sets_it():
    """One wrapper alone: its option is its value, the other option its default, whichever of the two it is."""
    for params, expected in (({"compress_every": 2}, (0, 2)), ({"rerotate": 1}, (1, 1))):
        policy = make_policy(CacheConfig(**BASE, policy_params=params))
        assert isinstance(policy, PolicyWrapper) and not isinstance(policy.inner, PolicyWrapper)
        assert bound_params(policy) == {"n_sink": 4, "rerotate": expected[0], "compress_every": expected[1]}
        assert (policy.rerotate, policy.compress_every) == expected


def _public(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_a_wrapper_exposes_exactly_the_policy_interface():
    """A wrapper answers POLICY_INTERFACE (each name a scorer has too), the scorer's answer where the wrapper adds
    nothing, and besides it only its options and what it wraps: a scorer's own parameters and methods the cache
    never asks (sinks' n_sink, head_scores, check_int_param) are not reachable through it."""
    policy = make_policy(CacheConfig(**BASE, policy_params={"rerotate": 1, "compress_every": 3}))
    scorer = unwrapped(policy)
    assert set(POLICY_INTERFACE) <= _public(scorer) and len(set(POLICY_INTERFACE)) == len(POLICY_INTERFACE)
    for wrapper in (policy, policy.inner):
        assert _public(wrapper) == set(POLICY_INTERFACE) | {"inner", "option", "rerotate", "compress_every"}
        for name in ("n_sink", "head_scores", "check_int_param", "citation", "page_size", "head_dim", "bind"):
            with pytest.raises(AttributeError):
                getattr(wrapper, name)
        for name in POLICY_INTERFACE:
            value = getattr(scorer, name)
            if not callable(value):
                assert getattr(wrapper, name) == value, name
    assert policy.layer_capacity(0) == make_policy(CacheConfig(**BASE)).layer_capacity(0) == 32
    assert policy.evicted_at_once() == 3 and policy.inner.evicted_at_once() == 1
    assert policy.rerotate == policy.inner.rerotate == 1 and policy.inner.compress_every == 1


def test_the_policy_interface_is_what_the_cache_and_the_engine_ask():
    """Every `policy.X` / `policy(seq_id).X` the cache and the engine read is in POLICY_INTERFACE (kvzip's chunk
    aside: a per-head policy is never wrapped), and every name in it is read there or by layer_capacities
    (policies/__init__.py binds a made policy's layers and heads)."""
    asked = set()
    for path in [*(PAGEVIS / "kvcache").glob("*.py"), *(PAGEVIS / "engine").glob("*.py")]:
        asked |= set(re.findall(r"\bpolicy(?:\([\w.]+\))?\.([a-z_]+)", path.read_text()))
    assert asked - {"chunk"} | {"bind_layers", "bind_heads"} == set(POLICY_INTERFACE)

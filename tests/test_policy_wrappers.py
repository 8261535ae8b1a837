"""Re-rotation and periodic compression are wrappers around any scorer (kvcache/policies/wrappers.py): make_policy
wraps a policy when its settings ask, the wrapped policy is still the scorer by name and parameters, and it answers
the cache's questions for what each wrapper adds."""

import copy

from pagevis.kvcache import CacheConfig, make_policy
from pagevis.kvcache.policies import bound_params
from pagevis.kvcache.policies.wrappers import KeyRerotation, PeriodicCompression, PolicyWrapper, unwrapped

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

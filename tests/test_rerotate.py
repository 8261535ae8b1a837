"""Re-rotation (rerotate=1, kvpress's KeyRerotationPress) against a brute-force float64 reference: after every
eviction the keys the cache holds equal keys computed by RoPE at the survivors' new positions, and a query's
attention equals dense attention over contiguous positions (survivors at 0..n-1, the query following them).

The cache keeps each query at its own position and moves older survivors later (see policies/base.py); so the
reference's "new position" of the survivor of rank i among n, under a newest position p, is p - (n - 1 - i).
"""

import numpy as np
import pytest
from engine_reference import dense_attention_f64

from pagevis.kvcache import CacheConfig, ConfigError, KVCacheManager

N_KV, N_HEADS, D, BASE = 2, 4, 16, 10000.0


def rope64(x, position):
    """x (n_kv, d) rotated to `position`, adjacent pairs, float64 (the model's RoPE, written out)."""
    out = np.empty(x.shape)
    for i in range(D // 2):
        angle = position * BASE ** (-2 * i / D)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * np.cos(angle) - b * np.sin(angle)
        out[..., 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
    return out


def config(policy, **params):
    return CacheConfig(page_size=4, max_pages=6, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=D,
                       rope_base=BASE, policy=policy, policy_params={"rerotate": 1, **params})


def stored(cache, seq_id):
    """{position: stored key (n_kv, d)} of a sequence's resident tokens."""
    store, ps = cache.stores[0], cache.page_size
    out = {}
    for page in cache.block_table(seq_id):
        for slot in range(ps):
            position = int(store.positions[page * ps + slot])
            if position >= 0:
                out[position] = store.k[:, page, slot].astype(np.float64)
    return out


def feed(cache, seq_id, raw_k, values, positions, chunk=1):
    for start in range(0, len(positions), chunk):
        batch = positions[start: start + chunk]
        k = np.stack([rope64(raw_k[p], p) for p in batch]).astype(np.float32)
        cache.extend(seq_id, batch)  # (token ids: the positions; a fork takes the parent's)
        cache.append(seq_id, 0, k, values[batch].astype(np.float32), np.array(batch))
        q = np.random.default_rng(int(batch[-1])).standard_normal((len(batch), N_HEADS, D)).astype(np.float32)
        cache.attend(seq_id, 0, q, np.array(batch))  # (policies that learn from attention see it)
        yield batch[-1]


@pytest.mark.parametrize("policy,params", [("sinks", {"n_sink": 2}), ("h2o", {}), ("tova", {}), ("oldest-page", {}),
                                           ("keydiff", {}), ("sinks", {"compress_every": 5}), ("random", {"seed": 3})])
def test_keys_equal_keys_computed_at_the_new_positions(policy, params):
    rng = np.random.default_rng(0)
    raw_k, values = rng.standard_normal((80, N_KV, D)), rng.standard_normal((80, N_KV, D))
    cache = KVCacheManager.single(config(policy, **params))
    evicted_any = False
    for newest in feed(cache, 0, raw_k, values, list(range(80)), chunk=1):
        keys = stored(cache, 0)
        order = sorted(keys)
        evicted_any |= order[0] > 0 or len(order) < newest + 1
        for rank, position in enumerate(order):
            expected = rope64(raw_k[position], newest - (len(order) - 1 - rank))
            np.testing.assert_allclose(keys[position], expected, rtol=0, atol=2e-5)
    assert evicted_any


def test_attention_equals_dense_attention_over_contiguous_positions():
    rng = np.random.default_rng(1)
    raw_k, values = rng.standard_normal((60, N_KV, D)), rng.standard_normal((60, N_KV, D))
    cache = KVCacheManager.single(config("h2o", recent=6))
    list(feed(cache, 0, raw_k, values, list(range(59)), chunk=7))
    p = 59
    k = rope64(raw_k[p], p)[None].astype(np.float32)
    cache.append(0, 0, k, values[[p]].astype(np.float32), np.array([p]))
    raw_q = rng.standard_normal((N_HEADS, D))
    result = cache.attend(0, 0, np.stack([rope64(raw_q, p)]).astype(np.float32), np.array([p]))
    survivors = cache.resident_positions(0, 0)
    n = len(survivors)
    assert n == 24 and survivors[-1] == p and p - survivors[0] + 1 > n  # holes: not contiguous
    keys = np.stack([rope64(raw_k[s], i) for i, s in enumerate(survivors)])
    expected, _ = dense_attention_f64(rope64(raw_q, n - 1), keys, values[survivors])
    np.testing.assert_allclose(result.output[0], expected, rtol=0, atol=1e-5)
    # without re-rotation the same cache attends at the true positions: a different result
    plain, _ = dense_attention_f64(rope64(raw_q, p), np.stack([rope64(raw_k[s], s) for s in survivors]),
                                   values[survivors])
    assert np.abs(plain - expected).max() > 1e-3


def test_a_shared_page_is_copied_before_its_keys_move():
    """A fork shares the parent's pages: re-rotating the child's keys leaves the parent's bit for bit."""
    rng = np.random.default_rng(2)
    raw_k, values = rng.standard_normal((60, N_KV, D)), rng.standard_normal((60, N_KV, D))
    cache = KVCacheManager(config("sinks", n_sink=1), pool_pages=20)
    cache.add_sequence(0)
    list(feed(cache, 0, raw_k, values, list(range(20)), chunk=4))
    before = stored(cache, 0)
    cache.fork(0, 1)
    list(feed(cache, 1, raw_k, values, list(range(20, 40))))
    after = stored(cache, 0)
    assert sorted(after) == sorted(before)
    for position, key in before.items():
        np.testing.assert_array_equal(after[position], key)
    child = stored(cache, 1)
    assert min(child) == 0 and len(child) == 24 and not np.array_equal(child[0], before[0])


@pytest.mark.parametrize("settings,field", [({"dtype": "int8"}, "sinks.rerotate"),
                                            ({"disk_pages": 12, "max_pages": 4}, "sinks.rerotate"),
                                            ({"policy": "adakv"}, "adakv.rerotate"),
                                            ({"policy": "none"}, "none.rerotate")])
def test_rerotation_is_refused_where_it_cannot_work(settings, field):
    kwargs = dict(page_size=4, max_pages=6, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=D,
                  policy="sinks", policy_params={"rerotate": 1})
    with pytest.raises(ConfigError) as error:
        CacheConfig(**{**kwargs, **settings})
    assert error.value.field == field


def test_models_that_rotate_otherwise_refuse_re_rotation_and_expected_attention_by_name():
    """Both redo RoPE as llama rotates (adjacent pairs, one base): Qwen rotates halves, so they are refused."""
    from pathlib import Path

    from pagevis.kvcache import CacheConfig, CacheSettings, ConfigError
    from pagevis.model import load_model

    qwen = load_model(Path(__file__).parent / "data" / "tiny-qwen2.gguf").config
    with pytest.raises(ConfigError, match="rerotate.*adjacent pairs"):
        CacheConfig.for_model(CacheSettings(policy="sinks", policy_params={"rerotate": 1}), qwen)
    with pytest.raises(ConfigError, match="expected-attention needs"):
        CacheConfig.for_model(CacheSettings(policy="expected-attention"), qwen)
    assert CacheConfig.for_model(CacheSettings(policy="sinks"), qwen).n_layers == qwen.n_layers

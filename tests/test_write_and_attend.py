"""A decode step's write and attention in one kernel call (KVCacheManager.write_and_attend) against the same cache fed
through `append` then `attend`: the same outputs and weights to the bit, the same cache afterwards (slots, tables,
occupancy, K/V, policy statistics, per-head masks, events); and its output against an independent float64 dense attention over the
tokens the layer holds."""

import numpy as np
from engine_reference import dense_attention_f64
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.kvcache import CacheConfig, KVCacheManager, paged_attention


@st.composite
def setups(draw):
    n_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3, 4, 6]))
    policy = draw(st.sampled_from(["none", "oldest", "sinks", "h2o", "tova", "snapkv", "adakv"]))
    # (adakv's SnapKV keeps a window of 8: a cache of at least 16 tokens)
    page_size = draw(st.sampled_from([4, 16] if policy == "adakv" else [1, 2, 4, 16]))
    max_pages = draw(st.integers(4 if policy == "adakv" else 2, 8))
    window = draw(st.sampled_from([None, 3, 8]))
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=2, n_heads=n_kv * group, n_kv_heads=n_kv,
                         head_dim=draw(st.sampled_from([4, 16, 64])), policy=policy,
                         policy_params={"sinks": {"n_sink": 1}, "snapkv": {"window": 1}}.get(policy, {}),
                         sliding_windows=None if window is None else (window, None))
    limit = config.capacity if policy == "none" else 3 * config.capacity  # (none never evicts: it fills)
    return config, draw(st.integers(1, limit)), draw(st.integers(0, 2**31))


def state(cache: KVCacheManager, layer: int) -> list:
    store, table = cache.stores[layer], cache.layers[layer].tables[0]
    stats = sorted((name, array.tolist()) for name, array in table.state.arrays.items())
    keep = None if table.head_keep is None else table.head_keep.tolist()  # (a per-head policy's masks)
    return [store.positions.tolist(), store.fill.tolist(), store.bias.tolist(), store.k.tolist(), store.v.tolist(),
            list(table.pages), sorted(table.holes), table.resident, stats, cache.sequences[0].newest, keep]


def reference(cache: KVCacheManager, layer: int, q: np.ndarray, position: int, window: int | None, stored: dict):
    """Float64 attention of the query over the tokens the layer holds (within its window); with per-head masks,
    each KV head's query heads over the tokens that KV head keeps."""
    keep, positions = cache.head_keep(0, layer), cache.stores[layer].positions
    n_kv = cache.stores[layer].k.shape[0]
    group = q.shape[1] // n_kv
    out = []
    for kv in range(n_kv):
        mine = positions[keep[kv]] if keep is not None else cache.resident_positions(0, layer)
        held = [p for p in sorted(mine.tolist()) if p >= 0 and (window is None or p > position - window)]
        keys = np.stack([stored[layer, p][0][kv: kv + 1] for p in held])
        values = np.stack([stored[layer, p][1][kv: kv + 1] for p in held])
        out.append(dense_attention_f64(q[0, kv * group: (kv + 1) * group], keys, values)[0])
    return np.concatenate(out)


@settings(max_examples=60, deadline=None)
@given(setups())
def test_write_and_attend_is_append_then_attend(setup):
    config, n_tokens, seed = setup
    rng = np.random.default_rng(seed)
    fused, plain = KVCacheManager.single(config), KVCacheManager.single(config)
    stored: dict = {}
    taken = []
    real = paged_attention.write_and_attend

    def spy(*args):
        result = real(*args)
        taken.append(result is not None)
        return result

    paged_attention.write_and_attend = spy
    try:
        for position in range(n_tokens):
            fused.step = plain.step = position
            for layer in range(config.n_layers):
                k, v = (rng.standard_normal((1, config.n_kv_heads, config.head_dim)).astype(np.float32) for _ in "kv")
                q = rng.standard_normal((1, config.n_heads, config.head_dim)).astype(np.float32)
                stored[layer, position] = k[0], v[0]
                positions = np.array([position])
                got = fused.write_and_attend(0, layer, q, k, v, positions)
                plain.append(0, layer, k, v, positions)
                want = plain.attend(0, layer, q, positions)
                assert np.array_equal(got.output, want.output) and np.array_equal(got.weights, want.weights)
                assert (got.slots is None) == (want.slots is None)
                window = config.sliding_windows[layer] if config.sliding_windows else None
                np.testing.assert_allclose(got.output[0], reference(fused, layer, q, position, window, stored),
                                           rtol=1e-5, atol=1e-5)
                assert state(fused, layer) == state(plain, layer)
            fused.commit(0)
            plain.commit(0)
            assert [repr(e) for e in fused.take_events()] == [repr(e) for e in plain.take_events()]  # (NaN scores)
    finally:
        paged_attention.write_and_attend = real
    # the one-call path ran: a second token fits in the first page
    assert any(taken) or config.page_size == 1 or n_tokens == 1

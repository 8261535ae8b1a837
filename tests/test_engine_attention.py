"""Paged attention against an independent float64 dense attention over exactly the resident tokens."""

import pytest
import numpy as np
from engine_reference import dense_attention_f64, weight_positions
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.kvcache import CacheConfig, KVCacheManager, attend, softmax


@st.composite
def cache_setups(draw):
    n_kv = draw(st.sampled_from([1, 2, 3, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4]))  # group == n_heads: multi-query when n_kv == 1
    page_size = draw(st.sampled_from([1, 2, 3, 8, 16, 32]))
    # a disk tier (RAM frames cache the pages; disk pages are read in batches and merged) or RAM only
    disk_pages = draw(st.sampled_from([0, 0, 1, 3, 12]))
    max_pages = draw(st.integers(2, 5)) if disk_pages else draw(st.integers(1, 12))
    policy = draw(st.sampled_from(["oldest", "oldest-page", "sinks", "h2o", "tova", "random"]))
    params = {"n_sink": min(4, page_size * (disk_pages or max_pages) - 1)} if policy == "sinks" else {}
    config = CacheConfig(
        page_size=page_size, max_pages=max_pages, disk_pages=disk_pages,
        n_layers=1, n_heads=n_kv * group, n_kv_heads=n_kv,
        head_dim=draw(st.sampled_from([4, 16, 64])),
        dtype=draw(st.sampled_from(["float32", "float16"])),
        policy=policy, policy_params=params,
    )
    # fill anywhere from one token to well past capacity, so pages wrap, holes and releases happen
    n_tokens = draw(st.integers(1, 3 * config.capacity))
    return config, n_tokens, draw(st.integers(0, 2**31))


def fill(config, n_tokens, seed):
    """Append n_tokens one at a time with attention after each; return the cache and K/V by position."""
    rng = np.random.default_rng(seed)
    cache = KVCacheManager.single(config)
    stored = {}
    shape = (1, config.n_kv_heads, config.head_dim)
    for position in range(n_tokens):
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        # the reference sees exactly what storage holds (float16 rounds on write)
        stored[position] = (k[0].astype(config.dtype), v[0].astype(config.dtype))
        cache.step = position
        cache.append(0, 0, k, v, np.array([position]))
        q = rng.standard_normal((1, config.n_heads, config.head_dim)).astype(np.float32)
        cache.attend(0, 0, q, np.array([position]))
    return cache, stored, rng


def relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(cache_setups())
def test_decode_attention_matches_dense_float64(setup):
    config, n_tokens, seed = setup
    cache, stored, rng = fill(config, n_tokens, seed)
    q = (3 * rng.standard_normal((1, config.n_heads, config.head_dim))).astype(np.float32)
    result = cache.attend(0, 0, q, np.array([n_tokens - 1]))

    resident = cache.resident_positions(0, 0)
    assert len(resident) == min(n_tokens, config.capacity) or config.policy == "oldest-page"
    keys = np.stack([stored[p][0] for p in resident])
    values = np.stack([stored[p][1] for p in resident])
    out, weights = dense_attention_f64(q[0], keys, values)

    assert relative_error(result.output[0], out) < 1e-5
    slot_positions = weight_positions(cache, 0, result)
    by_position = np.zeros((config.n_heads, n_tokens))
    occupied = slot_positions >= 0
    by_position[:, slot_positions[occupied]] = result.weights[0][:, occupied]
    assert relative_error(by_position[:, resident], weights) < 1e-5
    assert np.all(result.weights[0][:, ~occupied] == 0), "empty slots must get exactly zero weight"
    evicted = np.setdiff1d(np.arange(n_tokens), resident)
    assert np.all(by_position[:, evicted] == 0)


@settings(max_examples=40, deadline=None)
@given(cache_setups(), st.integers(1, 24))
def test_prefill_chunk_is_causal_and_matches_dense(setup, chunk):
    config, n_tokens, seed = setup
    n_before = n_tokens % max(config.capacity - chunk, 1) if config.capacity > chunk else 0
    chunk = min(chunk, config.capacity - n_before)
    cache, stored, rng = fill(config, n_before, seed)
    shape = (chunk, config.n_kv_heads, config.head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((chunk, config.n_heads, config.head_dim)).astype(np.float32)
    positions = np.arange(n_before, n_before + chunk)
    for i, p in enumerate(positions):
        stored[p] = (k[i].astype(config.dtype), v[i].astype(config.dtype))
    cache.append(0, 0, k, v, positions)
    result = cache.attend(0, 0, q, positions)

    for i, p in enumerate(positions):
        visible = [r for r in cache.resident_positions(0, 0) if r <= p]
        keys = np.stack([stored[r][0] for r in visible])
        values = np.stack([stored[r][1] for r in visible])
        out, _ = dense_attention_f64(q[i], keys, values)
        assert relative_error(result.output[i], out) < 1e-5
        # with a disk tier and a policy that ignores attention only the last query's weights come back
        row = i - len(positions) + len(result.weights)
        if row >= 0:
            future = weight_positions(cache, 0, result) > p
            assert np.all(result.weights[row][:, future] == 0), "a query saw a later token"


def test_dense_arrays_give_same_result_as_pool():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 6, 32)).astype(np.float32)
    keys = rng.standard_normal((3, 100, 32)).astype(np.float32)
    values = rng.standard_normal((3, 100, 32)).astype(np.float32)
    result = attend(q, keys, values)
    out, weights = dense_attention_f64(q[0], keys.transpose(1, 0, 2), values.transpose(1, 0, 2))
    assert relative_error(result.output[0], out) < 1e-5
    assert relative_error(result.weights[0], weights) < 1e-5


class TestSoftmax:
    def test_rows_sum_to_one(self):
        x = np.random.default_rng(0).standard_normal((50, 40)).astype(np.float32) * 10
        np.testing.assert_allclose(softmax(x.copy()).sum(-1), 1, rtol=1e-6)

    def test_large_inputs_do_not_overflow(self):
        x = np.array([[1e30, 1e30 - 1e24, -1e30], [3e38, 0, -3e38]], dtype=np.float32)
        p = softmax(x.copy())
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-6)

    def test_minus_infinity_gets_exactly_zero(self):
        x = np.array([[0.5, -np.inf, 2.0, -np.inf]], dtype=np.float32)
        p = softmax(x.copy())
        assert p[0, 1] == 0 and p[0, 3] == 0
        np.testing.assert_allclose(p.sum(), 1, rtol=1e-6)
        np.testing.assert_allclose(p[0, [0, 2]], np.exp([0.5, 2.0]) / np.exp([0.5, 2.0]).sum(), rtol=1e-6)

    def test_fully_masked_row_is_zeros_not_nan(self):
        p = softmax(np.full((1, 3), -np.inf, dtype=np.float32))
        assert np.all(p == 0)

    def test_matches_float64_formula(self):
        x = np.random.default_rng(3).standard_normal((4, 7))
        expected = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
        np.testing.assert_allclose(softmax(x.astype(np.float32)), expected, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_sequences_decoding_together_match_dense_float64_each_over_its_own_tokens(data):
    """attend_many (one batched kernel over several block tables, padded to the longest) against float64
    dense attention over each sequence's resident tokens; the same weights the one-sequence path gives."""
    n_kv, group = data.draw(st.sampled_from([1, 3])), data.draw(st.sampled_from([1, 3]))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    max_pages = data.draw(st.integers(1, 6))
    policy = data.draw(st.sampled_from(["oldest", "sinks", "h2o", "tova"]))
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=1, n_heads=n_kv * group,
                         n_kv_heads=n_kv, head_dim=16, dtype=data.draw(st.sampled_from(["float32", "float16"])),
                         policy=policy, policy_params={"n_sink": min(1, page_size * max_pages - 1)} if policy == "sinks" else {})
    n_seqs = data.draw(st.integers(2, 5))
    cache = KVCacheManager(config, pool_pages=n_seqs * max_pages)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    stored = {seq: {} for seq in range(n_seqs)}
    shape = (1, n_kv, config.head_dim)

    def append(seq: int) -> None:
        position = len(stored[seq])
        k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        stored[seq][position] = (k[0].astype(config.dtype), v[0].astype(config.dtype))
        cache.append(seq, 0, k, v, np.array([position]))

    for seq in range(n_seqs):
        cache.add_sequence(seq)
    # interleaved, unequal lengths: the sequences' pages alternate in the pool and their tables differ
    for seq in data.draw(st.lists(st.integers(0, n_seqs - 1), min_size=n_seqs, max_size=60)) + list(range(n_seqs)):
        append(seq)
    q = (3 * rng.standard_normal((n_seqs, config.n_heads, config.head_dim))).astype(np.float32)
    positions = np.array([len(stored[seq]) - 1 for seq in range(n_seqs)])
    assert cache.can_attend_many(list(range(n_seqs)), 0)
    results = cache.attend_many(list(range(n_seqs)), 0, q, positions)
    assert len(results) == n_seqs
    for seq, result in enumerate(results):
        resident = cache.resident_positions(seq, 0)
        keys = np.stack([stored[seq][p][0] for p in resident])
        values = np.stack([stored[seq][p][1] for p in resident])
        out, weights = dense_attention_f64(q[seq], keys, values)
        assert relative_error(result.output[0], out) < 1e-5
        slot_positions = weight_positions(cache, 0, result)
        occupied = slot_positions >= 0
        assert np.all(result.weights[0][:, ~occupied] == 0), "empty slots and padding get exactly zero weight"
        by_position = np.zeros((config.n_heads, len(stored[seq])))
        by_position[:, slot_positions[occupied]] = result.weights[0][:, occupied]
        assert relative_error(by_position[:, resident], weights) < 1e-5
        alone = cache.attend(seq, 0, q[seq: seq + 1], positions[seq: seq + 1])
        np.testing.assert_array_equal(alone.slots, result.slots)
        np.testing.assert_allclose(alone.weights, result.weights, rtol=1e-5, atol=1e-7)


def test_the_watched_attention_keeps_the_last_query_only():
    """The weights a session watches after a prefill are the last query's row, in an array of its own: a view
    of the chunk's (n, heads, keys) weights kept every layer alive (a 512-token SmolLM2 prompt: 310 MB)."""
    from pagevis.engine import DecodeSession, SessionConfig
    from pagevis.model.synthetic import SyntheticModel

    model = SyntheticModel(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16)
    session = DecodeSession(model, "", SessionConfig(page_size=8, max_pages=8, policy="none", max_new_tokens=2),
                            prompt_ids=list(range(40, 80)))
    session.step()
    for layer in range(3):
        weights, _ = session.engine.attention[session.seq_id][layer]
        assert weights.shape[0] == 4 and weights.base is None and weights.nbytes == weights.size * 4


def test_the_records_float16_conversion_is_numpys_bit_for_bit():
    """The record's attention is converted to float16 without NumPy's slow path for subnormals, to the same bits:
    random values from 2**-30 to 2**5 (most halves' subnormals and normals), zeros, infinities, NaN, ties."""
    from pagevis.engine.session import to_half

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-30, 5, 200_000))).astype(np.float32)
    x[:11] = [0, -0.0, np.inf, -np.inf, np.nan, 2**-24, 2**-25, 3 * 2**-26, 2**-14, -(2**-14) * 0.999, 1e-45]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = to_half(x.reshape(4, 50_000)).reshape(-1)
    assert got.dtype == np.float16
    same = (want.view(np.uint16) == got.view(np.uint16)) | (np.isnan(want) & np.isnan(got))
    assert same.all(), x[~same][:5]


def test_a_session_without_cache_grids_decodes_the_same_and_records_the_rest():
    """record_cache off (`run` without --trace): the records show no frame of the cache, and everything else they
    hold (tokens, residency, evictions, capacities) is the same as with the grids."""
    from pagevis.engine import DecodeSession, SessionConfig
    from pagevis.model.synthetic import SyntheticModel

    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
    config = SessionConfig(page_size=4, max_pages=3, policy="sinks", max_new_tokens=12, record_layers=())
    runs = []
    for grids in (True, False):
        session = DecodeSession(model, "", config, prompt_ids=list(range(40, 50)))
        session.record_cache = grids
        runs.append(list(session.run()))
    full, bare = runs
    assert bare[-1].slot_maps.shape == (2, 0, 4) and full[-1].slot_maps.shape == (2, 3, 4)
    assert [(r.next_token, r.resident_tokens, r.evictions_total, tuple(r.capacities)) for r in full] == [
        (r.next_token, r.resident_tokens, r.evictions_total, tuple(r.capacities)) for r in bare]

"""A decode query of one sequence among several (or alone in a pool aged by cached pages) reads its pages through
its block table where they lie (batch_decode_kernel.attend_tables, one sequence): against float64 dense attention
over exactly the resident tokens it sees, with a sliding window, float16 pages, holes, and per-head masks elsewhere."""

import numpy as np
import pytest
from engine_reference import dense_attention_f64, weight_positions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagevis.kvcache import CacheConfig, KVCacheManager, paged_attention


def relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


@pytest.fixture
def no_gather(monkeypatch):
    """The gathered NumPy path fails: a test using this reaches the block-table kernel or nothing."""
    def gathered(*args, **kwargs):
        raise AssertionError("a decode query gathered its pages")
    monkeypatch.setattr(paged_attention, "attend_kept", gathered)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # (no_gather
# holds for every example)
@given(st.data())
def test_a_decode_through_its_block_table_matches_dense_float64(no_gather, data):
    n_kv, group = data.draw(st.sampled_from([1, 3])), data.draw(st.sampled_from([1, 3]))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    max_pages = data.draw(st.integers(1, 6))
    window = data.draw(st.sampled_from([None, 3, 9]))
    policy = data.draw(st.sampled_from(["oldest", "sinks", "h2o", "tova"]))
    dtype = data.draw(st.sampled_from(["float32", "float16"]))
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=1, n_heads=n_kv * group,
                         n_kv_heads=n_kv, head_dim=16, dtype=dtype, policy=policy, sliding_windows=(window,),
                         policy_params={"n_sink": min(1, page_size * max_pages - 1)} if policy == "sinks" else {})
    n_seqs = data.draw(st.integers(2, 4))
    cache = KVCacheManager(config, pool_pages=n_seqs * max_pages)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    stored: dict[int, dict[int, tuple]] = {seq: {} for seq in range(n_seqs)}
    shape = (1, n_kv, config.head_dim)
    for seq in range(n_seqs):
        cache.add_sequence(seq)
    # interleaved, unequal lengths: the sequences' pages alternate in the pool (holes where policies evicted)
    for seq in data.draw(st.lists(st.integers(0, n_seqs - 1), min_size=n_seqs, max_size=60)) + list(range(n_seqs)):
        position = len(stored[seq])
        k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        stored[seq][position] = (k[0].astype(dtype), v[0].astype(dtype))
        cache.append(seq, 0, k, v, np.array([position]))
    seq = data.draw(st.integers(0, n_seqs - 1))
    position = len(stored[seq]) - 1
    q = (3 * rng.standard_normal((1, config.n_heads, config.head_dim))).astype(np.float32)
    result = cache.attend(seq, 0, q, np.array([position]))

    seen = [p for p in cache.resident_positions(seq, 0) if window is None or p > position - window]
    out, weights = dense_attention_f64(q[0], np.stack([stored[seq][p][0] for p in seen]),
                                       np.stack([stored[seq][p][1] for p in seen]))
    assert relative_error(result.output[0], out) < 1e-5
    slot_positions = weight_positions(cache, 0, result)
    by_position = np.zeros((config.n_heads, position + 1))
    shown = (slot_positions >= 0) & (slot_positions > (-1 if window is None else position - window))
    by_position[:, slot_positions[shown]] = result.weights[0][:, shown]
    assert relative_error(by_position[:, seen], weights) < 1e-5
    assert np.all(result.weights[0][:, ~shown] == 0), "empty slots and hidden keys get exactly zero weight"


def test_a_sole_sequence_in_an_aged_pool_reads_its_pages_in_place(no_gather):
    """The server's one client: the pool's used prefix is mostly other (cached) pages, so the sequence reads
    through its block table (LayerManager.gathers), not the prefix; the same output as a fresh pool's in place."""
    config = CacheConfig(page_size=4, max_pages=8, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16, policy="sinks")
    rng = np.random.default_rng(3)
    tokens = [rng.standard_normal((3, 1, 2, 16)).astype(np.float32) for _ in range(10)]  # q, k, v per position
    aged = KVCacheManager(config, pool_pages=24)
    aged.add_sequence(9)
    for position in range(40):  # another sequence's pages lie below ours, then go
        aged.append(9, 0, tokens[0][1], tokens[0][2], np.array([position]))
    aged.add_sequence(0)
    for position, (_, k, v) in enumerate(tokens):
        aged.append(0, 0, k, v, np.array([position]))
    aged.free(9)
    assert aged.layers[0].gathers(aged.sequences[0])
    fresh = KVCacheManager.single(config)
    for position, (_, k, v) in enumerate(tokens):
        fresh.append(0, 0, k, v, np.array([position]))
    q = rng.standard_normal((1, 6, 16)).astype(np.float32)
    expected = fresh.attend(0, 0, q, np.array([9]))
    result = aged.attend(0, 0, q, np.array([9]))
    np.testing.assert_allclose(result.output, expected.output, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_chunk_through_its_block_table_is_causal_and_matches_dense_float64(no_gather, data):
    """A prompt chunk of one sequence among several (the chunk kernel, one sequence): each query against float64
    dense attention over the resident tokens at or before it (and inside a window), the last query's weights."""
    n_kv, group = data.draw(st.sampled_from([1, 3])), data.draw(st.sampled_from([1, 3]))
    page_size, max_pages = data.draw(st.sampled_from([1, 4, 16])), data.draw(st.integers(2, 6))
    window = data.draw(st.sampled_from([None, 3, 9]))
    dtype = "float32"  # (float16 pages' chunk kernels: test_chunk_kernel, `make test-all`)
    policy = data.draw(st.sampled_from(["oldest", "sinks"]))
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=1, n_heads=n_kv * group,
                         n_kv_heads=n_kv, head_dim=16, dtype=dtype, policy=policy, sliding_windows=(window,),
                         policy_params={"n_sink": 1} if policy == "sinks" else {})
    capacity = page_size * max_pages
    chunk = data.draw(st.integers(2, min(capacity, 20)))
    n_before = data.draw(st.integers(0, capacity - chunk))
    cache = KVCacheManager(config, pool_pages=3 * max_pages)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    stored: dict[int, tuple] = {}
    for seq in (0, 1, 2):
        cache.add_sequence(seq)

    def token() -> tuple[np.ndarray, np.ndarray]:
        return tuple(rng.standard_normal((1, n_kv, 16)).astype(np.float32) for _ in range(2))

    others = [0, 0]
    for seq in data.draw(st.lists(st.sampled_from([0, 1, 2]), max_size=40)) + [0] * n_before:
        if seq == 0 and len(stored) >= n_before:
            continue
        k, v = token()
        if seq == 0:
            stored[len(stored)] = (k[0].astype(dtype), v[0].astype(dtype))
            cache.append(0, 0, k, v, np.array([len(stored) - 1]))
        else:
            cache.append(seq, 0, k, v, np.array([others[seq - 1]]))
            others[seq - 1] += 1
    k, v = (rng.standard_normal((chunk, n_kv, 16)).astype(np.float32) for _ in range(2))
    positions = np.arange(n_before, n_before + chunk)
    for i, p in enumerate(positions):
        stored[p] = (k[i].astype(dtype), v[i].astype(dtype))
    cache.append(0, 0, k, v, positions)
    q = (3 * rng.standard_normal((chunk, config.n_heads, 16))).astype(np.float32)
    # (before: a window's layer lets go of what fell below it once it attended)
    resident, slot_positions = cache.resident_positions(0, 0), cache.stores[0].positions.copy()
    result = cache.attend(0, 0, q, positions, all_weights=False)
    for i, p in enumerate(positions):
        seen = [r for r in resident if r <= p and (window is None or r > p - window)]
        out, weights = dense_attention_f64(q[i], np.stack([stored[r][0] for r in seen]),
                                           np.stack([stored[r][1] for r in seen]))
        assert relative_error(result.output[i], out) < 1e-5
    slot_positions = slot_positions[result.slots]
    shown = np.isin(slot_positions, seen)
    assert relative_error(result.weights[0][:, shown][:, np.argsort(slot_positions[shown])], weights) < 1e-5
    assert np.all(result.weights[0][:, ~shown] == 0)

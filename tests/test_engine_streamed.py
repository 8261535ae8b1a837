"""Streamed attention: parts of the keys attended separately and merged by log-sum-exp equal float64
dense attention over all of them, for any split into parts and any order of the keys."""

from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.kvcache import attend, attend_part, merge, rescale


def relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def dense_f64(q, keys, values, visible):
    """q (n, H, d); keys/values (n_kv, T, d); visible (n, T) bool. Plain float64 softmax attention."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    n, n_heads, d = q.shape
    group = n_heads // keys.shape[0]
    out = np.zeros((n, n_heads, d))
    weights = np.zeros((n, n_heads, keys.shape[1]))
    for i in range(n):
        for h in range(n_heads):
            scores = keys[h // group] @ q[i, h] / np.sqrt(d)
            scores[~visible[i]] = -np.inf
            if np.isfinite(scores).any():
                e = np.exp(scores - scores[np.isfinite(scores)].max())
                weights[i, h] = e / e.sum()
                out[i, h] = weights[i, h] @ values[h // group]
    return out, weights


@st.composite
def problems(draw):
    n_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from([4, 16, 64]))
    n_keys = draw(st.integers(1, 80))
    n_queries = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    q = (3 * rng.standard_normal((n_queries, n_kv * group, d))).astype(np.float32)
    keys = rng.standard_normal((n_kv, n_keys, d)).astype(np.float32)
    values = rng.standard_normal((n_kv, n_keys, d)).astype(np.float32)
    positions = rng.permutation(n_keys).astype(np.int64)  # keys in any order (pages out of order)
    bias = np.where(rng.random(n_keys) < 0.2, -np.inf, 0).astype(np.float32)  # some empty slots
    bias[rng.integers(n_keys)] = 0  # at least one resident key
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n_keys - 1)), max_size=6))) - {n_keys})
    return q, keys, values, positions, bias, [0, *cuts, n_keys]


@settings(max_examples=80, deadline=None)
@given(problems())
def test_streamed_equals_dense_float64_for_any_split_and_order(problem):
    q, keys, values, positions, bias, bounds = problem
    n = q.shape[0]
    q_positions = np.arange(positions.max() - n + 1, positions.max() + 1)  # a causal chunk's queries
    visible = (bias == 0)[None, :] & (positions[None, :] <= q_positions[:, None])
    parts, weights, whole = [], [], None
    for lo, hi in pairwise(bounds):
        part, w = attend_part(q, keys[:, lo:hi], values[:, lo:hi], bias[lo:hi], positions[lo:hi], q_positions)
        parts.append(part)
        weights.append(w)
        whole = part if whole is None else merge(whole, part)
    out, expected = dense_f64(q, keys, values, visible)
    assert relative_error(whole.output, out) < 1e-5
    merged = np.concatenate([w * rescale(p, whole)[..., None] for p, w in zip(parts, weights)], axis=-1)
    assert relative_error(merged, expected) < 1e-5
    assert np.all(merged[~np.broadcast_to(visible[:, None, :], merged.shape)] == 0)
    single = attend(q, keys, values, bias, positions, q_positions)
    assert relative_error(whole.output, single.output) < 1e-5


@settings(max_examples=60, deadline=None)
@given(problems())
def test_merge_is_associative_and_commutative(problem):
    q, keys, values, _, bias, _ = problem
    n_keys = keys.shape[1]
    a, b, c = (attend_part(q, keys[:, lo:hi], values[:, lo:hi], bias[lo:hi])[0]
               for lo, hi in ((0, n_keys // 3), (n_keys // 3, 2 * n_keys // 3), (2 * n_keys // 3, n_keys)))
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    for x, y in ((left, right), (left, merge(c, merge(b, a)))):
        np.testing.assert_allclose(x.output, y.output, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(x.max, y.max)
        np.testing.assert_allclose(x.total, y.total, rtol=1e-5)


def test_a_part_with_no_visible_key_changes_nothing():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    keys = rng.standard_normal((1, 6, 8)).astype(np.float32)
    seen, _ = attend_part(q, keys, keys)
    empty, w = attend_part(q, keys, keys, np.full(6, -np.inf, np.float32))
    assert np.all(np.isneginf(empty.max)) and not empty.total.any() and not w.any() and not empty.output.any()
    merged = merge(empty, seen)
    np.testing.assert_array_equal(merged.output, seen.output)
    np.testing.assert_array_equal(merged.total, seen.total)

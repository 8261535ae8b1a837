"""The attention kernel's paths (key blocks, value blocks, float16 chunks, masks) against a float64 dense
reference. The block sizes are measured per shape in normal use; here they are forced, so every path runs."""

from __future__ import annotations

import numpy as np
import pytest
from engine_reference import dense_attention_f64
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.kvcache import attend, attend_part, merge
from pagevis.kvcache import attention_kernels as kernel


def relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def reference(q, keys, values, bias=None, key_positions=None, q_positions=None):
    """Float64 attention of each query over the keys it may see (bias finite, position not in its future)."""
    keys = keys.astype(np.float64).transpose(1, 0, 2)  # (T, n_kv, d) for dense_attention_f64
    values = values.astype(np.float64).transpose(1, 0, 2)
    n, n_heads, d = q.shape
    out = np.zeros((n, n_heads, d))
    weights = np.zeros((n, n_heads, keys.shape[0]))
    for i in range(n):
        visible = np.ones(keys.shape[0], dtype=bool) if bias is None else np.isfinite(bias)
        if q_positions is not None and n > 1:
            visible &= key_positions <= q_positions[i]
        if visible.any():
            out[i], weights[i][:, visible] = dense_attention_f64(q[i], keys[visible], values[visible])
    return out, weights


@st.composite
def problems(draw):
    n_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3, 4]))
    d = draw(st.sampled_from([4, 16, 64]))
    n_keys = draw(st.integers(1, 700))
    n = draw(st.sampled_from([1, 1, 2, 5]))
    dtype = draw(st.sampled_from(["float32", "float16"]))
    blocks = (draw(st.sampled_from([0, 16, 32, 64, 256])), draw(st.sampled_from([0, 16, 32, 64, 256])))
    chunk_tokens = draw(st.sampled_from([1, 7, 64, 100, 4096]))
    masked = draw(st.sampled_from(["none", "some", "all"]))
    return n_kv, group, d, n_keys, n, dtype, blocks, chunk_tokens, masked, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_block_and_chunk_matches_float64(problem):
    n_kv, group, d, n_keys, n, dtype, blocks, chunk_tokens, masked, seed = problem
    rng = np.random.default_rng(seed)
    q = (2 * rng.standard_normal((n, n_kv * group, d))).astype(np.float32)
    keys = rng.standard_normal((n_kv, n_keys, d)).astype(dtype)
    values = rng.standard_normal((n_kv, n_keys, d)).astype(dtype)
    bias = None
    if masked != "none":
        bias = np.where(rng.random(n_keys) < (1.0 if masked == "all" else 0.3), -np.inf, 0).astype(np.float32)
    key_positions = rng.permutation(n_keys)
    q_positions = np.sort(rng.integers(0, n_keys, size=n))
    weights, output, peak, total = kernel._attention(q, keys, values, bias, key_positions, q_positions, blocks=blocks,
                                                     chunk_bytes=chunk_tokens * 4 * n_kv * d)
    out, expected = reference(q, keys, values, bias, key_positions, q_positions)
    got_out, got_weights = kernel._ungroup(output, n), kernel._ungroup(weights, n)
    assert got_out.dtype == got_weights.dtype == np.float32
    assert relative_error(got_out, out) < 1e-5
    assert relative_error(got_weights, expected) < 1e-5
    assert np.all(got_weights[expected == 0] == 0), "a masked key must get exactly zero weight"
    nothing = expected.sum(axis=-1) == 0
    assert np.all(kernel._ungroup(total, n)[nothing] == 0) and np.all(np.isneginf(kernel._ungroup(peak, n)[nothing]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_smollm2_decode_shape_at_8192_tokens_with_measured_blocks(dtype):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    keys = rng.standard_normal((3, 8192, 64)).astype(dtype)
    values = rng.standard_normal((3, 8192, 64)).astype(dtype)
    result = attend(q, keys, values)
    out, weights = reference(q, keys, values)
    assert relative_error(result.output, out) < 1e-5
    assert relative_error(result.weights, weights) < 1e-5
    assert kernel.block_sizes(3, 3, 64) == kernel.block_sizes(3, 3, 64)  # measured once, then cached


def test_float16_is_converted_chunk_by_chunk_never_whole(monkeypatch):
    """The float32 copies made of float16 keys and values are one chunk long, however long the cache."""
    sizes = []
    real_empty = np.empty

    def spy(shape, dtype=float, *args, **kwargs):
        array = real_empty(shape, dtype, *args, **kwargs)
        if array.dtype == np.float32 and array.ndim == 3 and array.shape[2] == 64:
            sizes.append(array.shape)
        return array

    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    keys = rng.standard_normal((3, 5000, 64)).astype(np.float16)
    monkeypatch.setattr(kernel.np, "empty", spy)
    kernel._attention(q, keys, keys, None, None, None, blocks=(64, 64), chunk_bytes=1000 * 4 * 3 * 64)
    assert (3, 1000, 64) in sizes and all(shape[1] <= 1000 for shape in sizes)


def test_parts_merge_to_the_whole_with_blocks():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 6, 32)).astype(np.float32)
    keys = rng.standard_normal((2, 900, 32)).astype(np.float32)
    values = rng.standard_normal((2, 900, 32)).astype(np.float32)
    first, _ = attend_part(q, keys[:, :500], values[:, :500])
    second, _ = attend_part(q, keys[:, 500:], values[:, 500:])
    whole = attend(q, keys, values)
    assert relative_error(merge(first, second).output, whole.output) < 1e-5


def test_no_key_at_all_gives_zeros():
    q = np.ones((1, 4, 8), np.float32)
    result = attend(q, np.zeros((2, 0, 8), np.float32), np.zeros((2, 0, 8), np.float32))
    assert np.all(result.output == 0) and result.weights.shape == (1, 4, 0)


def test_block_measurement_is_bounded_whatever_the_shape():
    """The server accepts up to 256 heads: a shape too wide for the measuring budget is not measured."""
    assert kernel.block_sizes(256, 1, 256) == (0, 0)
    assert kernel.block_sizes(3, kernel.DECODE_ROWS + 1, 64) == (0, 0)
    score, value = kernel.block_sizes(2, 2, 16)
    assert score in kernel.BLOCK_CANDIDATES and value in kernel.BLOCK_CANDIDATES


@settings(max_examples=80, deadline=None)
@given(n_kv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 4, 6, 9]), d=st.sampled_from([4, 64, 256]),
       n_keys=st.integers(1, 600), spare=st.integers(0, 40), masked=st.sampled_from(["none", "some", "all"]),
       window=st.sampled_from([None, 1, 7, 100]), seed=st.integers(0, 2**31))
def test_the_decode_kernel_reads_the_pools_prefix_and_matches_float64(n_kv, group, d, n_keys, spare, masked, window,
                                                                       seed):
    """attend_decode (one numba call for every head) over the first n_keys slots of a larger pool, in place, with an
    occupancy bias and a sliding window, against the float64 reference over exactly the keys the query may see."""
    rng = np.random.default_rng(seed)
    pool_k = rng.standard_normal((n_kv, n_keys + spare, d)).astype(np.float32)
    pool_v = rng.standard_normal((n_kv, n_keys + spare, d)).astype(np.float32)
    q = rng.standard_normal((1, n_kv * group, d)).astype(np.float32)
    bias = {"none": None, "some": np.where(rng.random(n_keys) < 0.3, -np.inf, 0).astype(np.float32),
            "all": np.full(n_keys, -np.inf, np.float32)}[masked]
    positions = rng.permutation(n_keys + spare).astype(np.int64)  # slots hold positions in any order
    position = int(positions[:n_keys].max())
    result = kernel.attend_decode(q, pool_k, pool_v, n_keys, bias, positions, position, window)
    visible = np.zeros(n_keys) if bias is None else bias.copy()
    if window:
        visible[(positions[:n_keys] <= position - window) | (positions[:n_keys] > position)] = -np.inf
    want_out, want_weights = reference(q, pool_k[:, :n_keys], pool_v[:, :n_keys], visible)
    assert result.weights.shape == (1, n_kv * group, n_keys) and np.all(result.weights[0][:, ~np.isfinite(visible)] == 0)
    np.testing.assert_allclose(result.output, want_out, atol=2e-5 * max(1.0, np.abs(want_out).max()))
    np.testing.assert_allclose(result.weights, want_weights, atol=2e-6)


@pytest.mark.parametrize("n_keys", [1, 2, 3, 5, 8, 37])
def test_the_decode_kernels_exponential_over_the_whole_float32_range(n_keys):
    """Scores spread from 0 down to far below exp's float32 floor (the kernel's own exponential, its key blocks and
    their tails): weights within float32 rounding of float64's, the tiny ones included, and exactly 0 under it."""
    rng = np.random.default_rng(n_keys)
    d, n_kv, group = 8, 2, 3
    keys = np.zeros((n_kv, n_keys, d), np.float32)
    keys[:, :, 0] = -np.linspace(0, 120, n_keys, dtype=np.float32)  # q . k = -(0 .. 120): exp from 1 to 1e-52
    values = rng.standard_normal((n_kv, n_keys, d)).astype(np.float32)
    q = np.zeros((1, n_kv * group, d), np.float32)
    q[..., 0] = np.sqrt(d) * rng.uniform(0.5, 1.0, n_kv * group)  # (attend_decode scales by 1/sqrt(d))
    result = kernel.attend_decode(q, keys, values, n_keys, None, None, 0, None)
    out, weights = reference(q, keys, values)
    tiny = np.finfo(np.float32).tiny  # under float32's smallest normal, a weight may be 0 (it is, below e^-87.4)
    np.testing.assert_allclose(result.weights, weights, rtol=2e-5, atol=tiny)  # (a score near -87 has ulp 8e-6)
    scores = q[0, :, 0, None].astype(np.float64) / np.sqrt(d) * np.repeat(keys[:, :, 0], group, axis=0)
    assert np.all(result.weights[0][scores - scores.max(axis=1, keepdims=True) < -87.4] == 0)
    np.testing.assert_allclose(result.output, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_kv, group, n_keys, window", [(2, 3, 37, None), (3, 4, 300, None), (4, 2, 64, 20),
                                                         (5, 3, 8, None)])
def test_per_head_masks_in_one_decode_call_equal_each_head_alone_and_float64(n_kv, group, n_keys, window):
    """attend_kept with per-KV-head masks (GQA groups; some heads drop slots, one keeps a single slot, one keeps all;
    empty slots in the occupancy bias) in one decode kernel call: bit for bit what each KV head's queries give alone
    (the kernel over that head with its mask added to the bias), and within 1e-5 of float64 per head."""
    from pagevis.kvcache.paged_attention import attend_kept

    rng = np.random.default_rng(n_kv * 1000 + n_keys)
    d = 64
    keys = rng.standard_normal((n_kv, n_keys, d)).astype(np.float32)
    values = rng.standard_normal((n_kv, n_keys, d)).astype(np.float32)
    q = rng.standard_normal((1, n_kv * group, d)).astype(np.float32)
    bias = np.where(rng.random(n_keys) < 0.2, -np.inf, 0).astype(np.float32)
    bias[-1] = 0
    keep = rng.random((n_kv, n_keys)) < 0.6
    keep[0] = True  # a head that dropped nothing
    keep[1] = False
    keep[1, -1] = True  # a head that dropped every slot but one (the newest: inside any window)
    key_positions = np.arange(n_keys, dtype=np.int64)
    positions = np.array([n_keys - 1], np.int64)
    got = attend_kept(q, keys, values, bias, key_positions, positions, keep, window)
    head_bias = np.where(keep, np.float32(0), np.float32(-np.inf)) + bias
    visible = head_bias.copy()
    if window:
        visible[:, key_positions <= positions[0] - window] = -np.inf
    for h in range(n_kv):
        rows = slice(h * group, (h + 1) * group)
        alone = kernel.attend(q[:, rows], keys[h: h + 1], values[h: h + 1], head_bias[h], key_positions, positions,
                              window)
        assert np.array_equal(got.output[:, rows], alone.output) and np.array_equal(got.weights[:, rows], alone.weights)
        want_out, want_weights = reference(q[:, rows], keys[h: h + 1], values[h: h + 1], visible[h])
        np.testing.assert_allclose(got.output[:, rows], want_out, atol=1e-5)
        np.testing.assert_allclose(got.weights[:, rows], want_weights, atol=1e-5)
        assert np.all(got.weights[0, rows][:, ~np.isfinite(visible[h])] == 0)
    assert np.count_nonzero(got.weights[0, group]) == 1  # head 1 sees only its one kept slot

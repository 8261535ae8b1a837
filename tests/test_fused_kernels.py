"""model/fused_kernels.py against float64 NumPy written from the definitions: each kernel within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.model.decoder import NO_ROWS, NOTHING, _fused

EPS = np.float32(1e-6)


def rows(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def rms64(x, weight, eps=EPS):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + float(eps)) * weight.astype(np.float64)


def close(got, want, rtol=3e-6):
    """Within a few float32 ulps of the float64 value (relative to the row's size where it nears zero)."""
    scale = np.max(np.abs(want), axis=-1, keepdims=True)
    assert np.all(np.abs(got - want) <= rtol * (np.abs(want) + 1e-2 * scale)), np.max(np.abs(got - want))


@pytest.mark.parametrize("with_post", [False, True])
def test_residual_norm_adds_then_norms(with_post):
    rng = np.random.default_rng(0)
    x, delta, weight = rows(rng, 5, 96), rows(rng, 5, 96, scale=30.0), rows(rng, 96)
    post = rows(rng, 96) if with_post else NOTHING
    out = np.empty_like(x)
    added = x.astype(np.float64) + (rms64(delta, post) if with_post else delta.astype(np.float64))
    _fused().residual_norm(x, delta, post, weight, EPS, out)
    close(x, added)
    close(out, rms64(added, weight))


def test_residual_norm_without_a_delta_only_norms():
    rng = np.random.default_rng(1)
    x, weight = rows(rng, 3, 64, scale=1e-3), rows(rng, 64)
    before, out = x.copy(), np.empty_like(x)
    _fused().residual_norm(x, NO_ROWS, NOTHING, weight, EPS, out)
    assert np.array_equal(x, before)
    close(out, rms64(before, weight))


def rope64(x, angles, neox):
    """x (heads, d) float64 rotated by angles (d / 2,): pairs (2i, 2i+1), or (i, i + d/2) when neox."""
    d = x.shape[-1]
    first, second = (x[:, :d // 2], x[:, d // 2:]) if neox else (x[:, 0::2], x[:, 1::2])
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.empty_like(x)
    if neox:
        out[:, :d // 2], out[:, d // 2:] = first * cos - second * sin, second * cos + first * sin
    else:
        out[:, 0::2], out[:, 1::2] = first * cos - second * sin, first * sin + second * cos
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("extras", [False, True])  # bias, q/k norms and a query scale (Qwen 2 / Gemma 3's)
def test_prepare_qkv_matches_bias_norm_rope_scale(neox, extras):
    rng = np.random.default_rng(2)
    n, heads, kv, d = 3, 4, 2, 16
    width = (heads + 2 * kv) * d
    qkv = rows(rng, n, width, scale=3.0)
    bias, q_norm, k_norm = (rows(rng, width), rows(rng, d), rows(rng, d)) if extras else (NOTHING,) * 3
    scale = np.float32(0.37 if extras else 1.0)
    angles = np.array([0, 7, 4000])[:, None] * (10000.0 ** (-np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    q, k, v = np.empty((n, heads, d), np.float32), np.empty((n, kv, d), np.float32), np.empty((n, kv, d), np.float32)
    _fused().prepare_qkv(qkv, bias, q_norm, k_norm, EPS, cos, sin, neox, scale, q, k, v)
    full = qkv.astype(np.float64) + (bias.astype(np.float64) if extras else 0)
    for i in range(n):
        q64 = full[i, :heads * d].reshape(heads, d)
        k64 = full[i, heads * d:(heads + kv) * d].reshape(kv, d)
        if extras:
            q64, k64 = rms64(q64, q_norm), rms64(k64, k_norm)
        # the float32 tables are the angles the kernel turns by: the reference uses them too
        exact = np.arctan2(sin[i].astype(np.float64), cos[i].astype(np.float64))
        close(q[i], rope64(q64, exact, neox) * float(scale))
        close(k[i], rope64(k64, exact, neox))
        close(v[i], full[i, (heads + kv) * d:].reshape(kv, d), rtol=1e-7)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation(gelu):
    """Within float32 rounding of the inputs' size, as layers.py's NumPy form is: the activation's argument is
    itself rounded (a GELU's tail, exp(-a) for a ~ 10, moves by a few ulps of a)."""
    from pagevis.model.layers import gelu_tanh_mul, silu_mul

    rng = np.random.default_rng(3)
    d_ff = 200
    gate_up = rows(rng, 4, 2 * d_ff, scale=4.0)
    gate_up[0, :8] = [0, -0.0, 1e-8, -1e-8, 100, -100, 300, -300]  # zeros, tiny, and where exp saturates
    out = np.empty((4, d_ff), np.float32)
    _fused().gated(gate_up, d_ff, gelu, out)
    g, up = gate_up[:, :d_ff].astype(np.float64), gate_up[:, d_ff:].astype(np.float64)
    # 0.5 (1 + tanh(z)) = sigmoid(2 z): the stable form of the tanh GELU in float64
    a = 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3) if gelu else g
    with np.errstate(over="ignore"):
        want = g * up / (1 + np.exp(-a))
    bound = 1e-6 * np.abs(g * up) + 1e-37
    assert np.all(np.abs(out - want) <= bound), np.max(np.abs(out - want) / bound)
    with np.errstate(over="ignore"):
        numpy_form = (gelu_tanh_mul if gelu else silu_mul)(gate_up[:, :d_ff], gate_up[:, d_ff:])
    assert np.all(np.abs(numpy_form - want) <= bound)  # the same bound holds the NumPy form


def test_exp_within_two_ulps_over_its_range():
    """The vectorisable exp (Cephes' expf) against float64's, over [-87, 88] where it is not clamped."""
    from numba import njit

    from pagevis.model import fused_kernels

    exp = fused_kernels._exp

    @njit
    def every(values, out):
        for j in range(values.shape[0]):
            out[j] = exp(values[j])

    values = np.linspace(-87, 88, 200_001, dtype=np.float32)
    out = np.empty_like(values)
    every(values, out)
    want = np.exp(values.astype(np.float64))
    assert np.all(np.abs(out - want) <= 2 * np.spacing(want.astype(np.float32)))


def test_rope_tables_match_float64_for_every_key():
    from pagevis.model.rope import inverse_frequencies

    positions = np.array([0, 1, 17, 4095, 131071], np.int64)
    inv = np.stack([inverse_frequencies(64, 10000.0), inverse_frequencies(64, 1e6, scale=8.0)])
    cos, sin = np.empty((2, 5, 32), np.float32), np.empty((2, 5, 32), np.float32)
    _fused().rope_tables(positions, inv, cos, sin)
    angles = positions[None, :, None] * inv[:, None, :]
    assert np.all(np.abs(cos - np.cos(angles)) <= 6e-8) and np.all(np.abs(sin - np.sin(angles)) <= 6e-8)


def test_one_embedding_row_is_its_tiles_row():
    """QuantMatrix.rows' one-row path (a decode step's Q8_0 token, without dequantising its 64-row tile) gives the
    tile path's bits, and gguf-py's dequantiser's values."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from pagevis.model.quantized import pack

    weights = np.random.default_rng(5).standard_normal((130, 64)).astype(np.float32)
    raw = quantize(weights, Q.Q8_0)
    matrix, want = pack(Q.Q8_0, raw, 64), dequantize(raw, Q.Q8_0)
    for row in (0, 63, 64, 129):
        one = matrix.rows(np.array([row]))
        assert one.shape == (1, 64) and np.array_equal(one, matrix.rows(np.array([row, 0]))[:1])
        np.testing.assert_allclose(one[0], want[row], rtol=1e-6)

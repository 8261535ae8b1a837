"""The decoder's work between the weight products, fused into three numba calls a block (model/decoder.py).

At decode a row is 576-640 floats: the NumPy form of a layer (RMSNorm, RoPE, the gated activation, residual adds:
~40 ufunc calls) cost ~40 µs of call overhead, more than its arithmetic. Here each step is one call over all rows:

- `residual_norm(x, delta, post, weight, eps, out)`: x += delta (RMSNorm'd by `post` first when post is not empty:
  Gemma 3's sandwich norms); then out = RMSNorm(x) * weight. A delta of 0 rows adds nothing (the first layer).
- `prepare_qkv(qkv, bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, q, k, v)`: one projection's rows
  (q | k | v per row) into q (n, heads, d), k and v (n, kv_heads, d): the bias added (when not empty), Q and K
  RMSNorm'd per head (when their weights are not empty), rotated (adjacent pairs, or halves when neox), Q times
  q_scale.
- `gated(gate_up, d_ff, gelu, out)`: out = act(gate) * up, gate and up the halves of each row; act SiLU, or GELU
  (tanh form) when gelu. Both as g * sigmoid(a): SiLU a = g, GELU a = 2 c (g + 0.044715 g^3), since
  0.5 (1 + tanh(z)) = sigmoid(2 z).

Sums of squares are taken in float64 (closer to exact than NumPy's float32 pairwise sum); everything else is
float32, products fused where the CPU can (`contract`). exp is Cephes' expf polynomial (about 1 ulp), written so
LLVM vectorises it: numba has no vector exp without Intel's SVML, and a scalar expf per element made the GELU of a
512-row prefill several times slower than NumPy's. The float64 references in tests/test_fused_kernels.py hold
each kernel to float32 rounding.

Compiled with explicit signatures and kept in numba's on-disk cache (cache=True) as the weight kernels are; loaded
by `kernels()` on the first forward (~1-2 s to compile once, ~0.1 s to load).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagevis.kernel_intrinsics import NjitOptions, exp_in_range

_ROWS = "float32[:, ::1]"
_VEC = "float32[::1]"
_HEADS = "float32[:, :, ::1]"

# products and sums may fuse into FMAs (one rounding instead of two); sums of squares may be reordered (vectorised)
_OPTIONS: NjitOptions = {"cache": True, "nogil": True, "fastmath": {"contract"}, "error_model": "numpy",
                         "boundscheck": False}
_SUM_OPTIONS: NjitOptions = {**_OPTIONS, "fastmath": {"reassoc", "contract"}}

GELU_C = np.float32(np.sqrt(2 / np.pi))


@njit(inline="always", **_OPTIONS)
def _exp(x):  # pragma: no cover (numba)
    """exp(x) in float32 for x clamped to [-87, 88] (kernel_intrinsics.exp_in_range)."""
    return exp_in_range(min(max(x, np.float32(-87.0)), np.float32(88.0)))


@njit(**_SUM_OPTIONS)
def _inverse_rms(row, eps):  # pragma: no cover (numba)
    total = 0.0
    for j in range(row.shape[0]):
        value = np.float64(row[j])
        total += value * value
    return np.float32(1.0 / np.sqrt(total / row.shape[0] + np.float64(eps)))


@njit(f"void({_ROWS}, {_ROWS}, {_VEC}, {_VEC}, float32, {_ROWS})", **_OPTIONS)
def residual_norm(x, delta, post, weight, eps, out):  # pragma: no cover (numba)
    n, d = x.shape
    for i in range(n):
        row = x[i]
        if delta.shape[0] > 0:
            added = delta[i]
            if post.shape[0] > 0:
                scale = _inverse_rms(added, eps)
                for j in range(d):
                    row[j] += added[j] * scale * post[j]
            else:
                for j in range(d):
                    row[j] += added[j]
        scale = _inverse_rms(row, eps)
        target = out[i]
        for j in range(d):
            target[j] = row[j] * scale * weight[j]


@njit(inline="always", **_OPTIONS)
def _rope(source, start, cos, sin, neox, scale, target):  # pragma: no cover (numba)
    """target (d,) = source[start:start + d] rotated, times scale (source may be target, start 0: each pair is read
    before it is written)."""
    half = target.shape[0] // 2
    if neox:
        for j in range(half):
            first, second = source[start + j], source[start + j + half]
            target[j] = (first * cos[j] - second * sin[j]) * scale
            target[j + half] = (second * cos[j] + first * sin[j]) * scale
    else:
        for j in range(half):
            even, odd = source[start + 2 * j], source[start + 2 * j + 1]
            target[2 * j] = (even * cos[j] - odd * sin[j]) * scale
            target[2 * j + 1] = (even * sin[j] + odd * cos[j]) * scale


@njit(inline="always", **_OPTIONS)
def _head(source, start, bias, norm, eps, cos, sin, neox, scale, target):  # pragma: no cover (numba)
    """One head of a projection row (source[start:start + d]) into target (d,): bias, RMSNorm, RoPE, scale."""
    d = target.shape[0]
    for j in range(d):
        target[j] = source[start + j]
    if bias.shape[0] > 0:
        for j in range(d):
            target[j] += bias[start + j]
    if norm.shape[0] > 0:
        inverse = _inverse_rms(target, eps)
        for j in range(d):
            target[j] = target[j] * inverse * norm[j]
    _rope(target, 0, cos, sin, neox, scale, target)


@njit(f"void({_ROWS}, {_VEC}, {_VEC}, {_VEC}, float32, {_ROWS}, {_ROWS}, boolean, float32, {_HEADS}, {_HEADS}, "
      f"{_HEADS})", **_OPTIONS)
def prepare_qkv(qkv, bias, q_norm, k_norm, eps, cos, sin, neox, q_scale, q, k, v):  # pragma: no cover (numba)
    n, n_heads, d = q.shape
    n_kv = k.shape[1]
    q_dim, kv_dim = n_heads * d, n_kv * d
    one = np.float32(1.0)
    plain = bias.shape[0] == 0 and q_norm.shape[0] == 0 and k_norm.shape[0] == 0
    for i in range(n):
        row = qkv[i]
        if plain:  # rotated where they lie (Llama's: a third of the time of staging each head)
            for h in range(n_heads):
                _rope(row, h * d, cos[i], sin[i], neox, q_scale, q[i, h])
            for h in range(n_kv):
                _rope(row, q_dim + h * d, cos[i], sin[i], neox, one, k[i, h])
        else:
            for h in range(n_heads):
                _head(row, h * d, bias, q_norm, eps, cos[i], sin[i], neox, q_scale, q[i, h])
            for h in range(n_kv):
                _head(row, q_dim + h * d, bias, k_norm, eps, cos[i], sin[i], neox, one, k[i, h])
        for h in range(n_kv):
            start = q_dim + kv_dim + h * d
            target = v[i, h]
            for j in range(d):
                target[j] = row[start + j]
            if bias.shape[0] > 0:
                for j in range(d):
                    target[j] += bias[start + j]


@njit(f"void({_ROWS}, int64, boolean, {_ROWS})", **_OPTIONS)
def gated(gate_up, d_ff, gelu, out):  # pragma: no cover (numba)
    n = gate_up.shape[0]
    for i in range(n):
        row, target = gate_up[i], out[i]
        if gelu:
            for j in range(d_ff):
                g = row[j]
                a = np.float32(2.0) * GELU_C * (g + np.float32(0.044715) * g * g * g)
                target[j] = g / (np.float32(1.0) + _exp(-a)) * row[d_ff + j]
        else:
            for j in range(d_ff):
                g = row[j]
                target[j] = g / (np.float32(1.0) + _exp(-g)) * row[d_ff + j]



@njit("void(int64[::1], float64[:, ::1], float32[:, :, ::1], float32[:, :, ::1])", **_OPTIONS)
def rope_tables(positions, inv_freqs, cos, sin):  # pragma: no cover (numba)
    """cos[key, i, j], sin[key, i, j] of the angle positions[i] * inv_freqs[key, j], formed in float64 (rope.py's
    rope_rows, in one call for every key: a decode step's one row)."""
    for key in range(inv_freqs.shape[0]):
        for i in range(positions.shape[0]):
            position = np.float64(positions[i])
            for j in range(inv_freqs.shape[1]):
                angle = position * inv_freqs[key, j]
                cos[key, i, j] = np.float32(np.cos(angle))
                sin[key, i, j] = np.float32(np.sin(angle))

"""Decode attention in one numba call per layer: one query token, every head, K/V read where they lie.

`attend_one(q, scale, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window, out, weights)`:
  q (n_heads, d) float32, scaled here by `scale` (1/sqrt(d)); k, v (n_kv, S, d) float32, C-contiguous: the pool's
  frames as one array (a page-store's (n_kv, pages, page_size, d) reshaped, free), of which the first n_keys
  slots are read; with slot >= 0, the new token's k_new, v_new (n_kv, d) are written into that slot first (a
  decode step's write and attention in one call); bias additive (0 resident, -inf empty or dropped): (1, n_keys)
  for every KV head, (n_kv, n_keys) one row a KV head (a per-head policy's masks: all heads in one call), or
  (0, 0), none; with window > 0, key_positions (n_keys,) and the query's position: keys at or below position - window (or after it)
  are hidden.
  Writes out (n_heads, d) and weights (n_heads, n_keys), normalised, exactly 0 on hidden keys; a head that
  sees no key gets zeros. The slots read hold finite numbers (the pool starts zeroed): a hidden key's value is
  multiplied by its weight, 0.
Query head h reads KV head h // group. The query heads of a KV head go through in chunks of up to ROWS rows, so
each key and value row loaded serves every row of the chunk (GQA): scores for two keys at a time (ROWS x 2 dot
products sharing their loads), then the softmax, then the values four keys at a time into ROWS accumulator rows.
A chunk of fewer rows repeats its last query row in the spare slots (computed, not stored). Each sweep asks for
the rows PREFETCH_AHEAD bytes ahead of those it reads (the K/V come from memory). The exponential is
Cephes' float32 polynomial (within 2 ulp of exp; written as arithmetic, so the loop vectorises, where a libm call
per weight cost more than the rest of the softmax). Sums may be taken in any order (fastmath reassoc), so a score
differs from NumPy's by float32 rounding only; the float64 reference tests and paged = dense hold it to that.

Compiled once with an explicit signature and kept in numba's on-disk cache (cache=True), as the weight kernels
are (model/weight_kernels.py); this module is imported on the first decode step that uses it (engine.py loads it
before, attention_kernels.load_decode_kernel).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagevis.kernel_intrinsics import exp_in_range, prefetch

_SIGNATURE = ("void(float32[:, ::1], float32, float32[:, :, ::1], float32[:, :, ::1], int64, float32[:, ::1], "
              "float32[:, ::1], int64, float32[:, ::1], int64[::1], int64, int64, float32[:, ::1], float32[:, ::1])")
_FAST = {"reassoc", "contract"}
ROWS = 4  # query rows (of one KV head's group) per sweep over the keys
# bytes ahead of the rows in use that the sweeps ask for: the cache's K/V come from memory (a decode step's weights
# pushed them out of every cache), and the hardware prefetcher alone kept one layer's read at ~14 GB/s (measured:
# SmolLM2's 512 keys, 0.79 MB, 55-75 us a layer with cold caches; 35-60 with this, under a loaded machine)
PREFETCH_AHEAD = 8192
EXP_FLOOR = np.float32(-87.33654)  # below, exp is under float32's smallest normal: taken as 0 (so is -inf)


@njit(cache=True, nogil=True, inline="always")
def _ask_ahead(array, h, t, n_rows):  # pragma: no cover (numba)
    """The cache lines PREFETCH_AHEAD bytes past rows t .. t + n_rows of array[h], asked for."""
    row_bytes = array.shape[2] * 4
    at = array.ctypes.data + (h * array.shape[1] + t) * row_bytes + PREFETCH_AHEAD
    for b in range(0, n_rows * row_bytes, 64):
        prefetch(at + b)  # type: ignore[call-arg]


@njit(cache=True, nogil=True, inline="always")
def _ask_starts(array, n_keys):  # pragma: no cover (numba)
    """The first PREFETCH_AHEAD bytes of every head's rows of array (up to n_keys rows), asked for at once: the
    sweeps ask ahead only of where they read, and a stream's start from memory, one line after another, cost more
    than the kernel's arithmetic when there are few keys (measured: a call after 23 tokens, 13 us against 4 warm)."""
    row_bytes = array.shape[2] * 4
    for h in range(array.shape[0]):
        at = array.ctypes.data + h * array.shape[1] * row_bytes
        for b in range(0, min(n_keys * row_bytes, PREFETCH_AHEAD), 64):
            prefetch(at + b)  # type: ignore[call-arg]


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _exp(x):  # pragma: no cover (numba)
    """exp(x) for x <= 0 in float32 (kernel_intrinsics.exp_in_range); exactly 0 below EXP_FLOOR and for -inf."""
    p = exp_in_range(max(x, EXP_FLOOR))
    return p if x >= EXP_FLOOR else np.float32(0)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _scores(q, k, h, first, rows, n_keys, weights):  # pragma: no cover (numba)
    """weights[first + i, t] = q[first + i] . k[h, t] for the chunk's rows, two keys at a time."""
    d = q.shape[1]
    last = first + rows - 1
    q0, q1, q2, q3 = q[first], q[min(first + 1, last)], q[min(first + 2, last)], q[min(first + 3, last)]
    body = n_keys // 2 * 2
    for t in range(0, body, 2):
        r0, r1 = k[h, t], k[h, t + 1]
        _ask_ahead(k, h, t, 2)
        s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0)
        for j in range(d):
            x, y = r0[j], r1[j]
            s00 += q0[j] * x
            s01 += q0[j] * y
            s10 += q1[j] * x
            s11 += q1[j] * y
            s20 += q2[j] * x
            s21 += q2[j] * y
            s30 += q3[j] * x
            s31 += q3[j] * y
        weights[first, t], weights[first, t + 1] = s00, s01
        if rows > 1:
            weights[first + 1, t], weights[first + 1, t + 1] = s10, s11
        if rows > 2:
            weights[first + 2, t], weights[first + 2, t + 1] = s20, s21
        if rows > 3:
            weights[first + 3, t], weights[first + 3, t + 1] = s30, s31
    for t in range(body, n_keys):
        for g in range(first, first + rows):
            s = np.float32(0)
            for j in range(d):
                s += q[g, j] * k[h, t, j]
            weights[g, t] = s


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _softmax(weights, g, n_keys):  # pragma: no cover (numba)
    """Row g of the scores into weights, in place; a row with no visible key (all -inf) into zeros. Whether it
    had one."""
    row = weights[g]
    peak = np.float32(-np.inf)
    for t in range(n_keys):
        peak = max(peak, row[t])
    if peak == -np.inf:
        row[:n_keys] = 0
        return False
    total = np.float32(0)
    for t in range(n_keys):
        e = _exp(row[t] - peak)
        row[t] = e
        total += e
    inverse = np.float32(1) / total
    for t in range(n_keys):
        row[t] *= inverse
    return True


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _values(weights, v, h, first, rows, n_keys, acc):  # pragma: no cover (numba)
    """acc[i] = sum over t of weights[first + i, t] v[h, t] for the chunk's rows (acc: ROWS distinct rows, so
    the compiler sees four outputs that do not overlap), four keys at a time."""
    d = v.shape[2]
    last = first + rows - 1
    w0, w1, w2, w3 = weights[first], weights[min(first + 1, last)], weights[min(first + 2, last)], weights[
        min(first + 3, last)]
    o0, o1, o2, o3 = acc[0], acc[1], acc[2], acc[3]
    acc[:, :d] = 0
    body = n_keys // 4 * 4
    for t in range(0, body, 4):
        r0, r1, r2, r3 = v[h, t], v[h, t + 1], v[h, t + 2], v[h, t + 3]
        _ask_ahead(v, h, t, 4)
        a0, a1, a2, a3 = w0[t], w0[t + 1], w0[t + 2], w0[t + 3]
        b0, b1, b2, b3 = w1[t], w1[t + 1], w1[t + 2], w1[t + 3]
        c0, c1, c2, c3 = w2[t], w2[t + 1], w2[t + 2], w2[t + 3]
        e0, e1, e2, e3 = w3[t], w3[t + 1], w3[t + 2], w3[t + 3]
        for j in range(d):
            x0, x1, x2, x3 = r0[j], r1[j], r2[j], r3[j]
            o0[j] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
            o1[j] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
            o2[j] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
            o3[j] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
    for t in range(body, n_keys):
        for i in range(rows):
            w = weights[first + i, t]
            for j in range(d):
                acc[i, j] += w * v[h, t, j]


@njit(_SIGNATURE, cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def attend_one(q, scale, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window, out,
               weights):  # pragma: no cover (numba)
    n_heads, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    if slot >= 0:
        k[:, slot] = k_new
        v[:, slot] = v_new
    _ask_starts(k, n_keys)
    _ask_starts(v, n_keys)
    q = q * scale
    acc = np.empty((ROWS, d), np.float32)
    for h in range(n_kv):
        for first in range(h * group, (h + 1) * group, ROWS):
            rows = min(ROWS, (h + 1) * group - first)
            _scores(q, k, h, first, rows, n_keys, weights)
            for g in range(first, first + rows):
                row = weights[g]
                if bias.shape[0] > 0:
                    head_bias = bias[h if bias.shape[0] > 1 else 0]
                    for t in range(n_keys):
                        row[t] += head_bias[t]
                if window > 0:
                    for t in range(n_keys):
                        if key_positions[t] <= position - window or key_positions[t] > position:
                            row[t] = -np.inf
                _softmax(weights, g, n_keys)
            _values(weights, v, h, first, rows, n_keys, acc)
            for i in range(rows):
                out[first + i] = acc[i]


NO_BIAS = np.zeros((0, 0), np.float32)
NO_POSITIONS = np.zeros(0, np.int64)
NO_ROW = np.zeros((0, 0), np.float32)  # k_new, v_new when nothing is written (slot -1)

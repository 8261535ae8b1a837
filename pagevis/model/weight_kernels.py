"""Numba kernels that multiply activations by quantised weights in their packed form (see quantized.py).

Three packed formats cover every supported ggml type (quantized.py repacks each into one of them at load):
  u4: 4-bit codes q in 0..15, per 32-weight group a scale d and an offset m: w = d*q + m
      (Q4_0: m = -8d; Q4_1; Q4_K: d = super-scale * 6-bit scale, m = -super-min * 6-bit min)
  u5: u4's nibbles plus one high bit per weight (a uint32 per group): q in 0..31, w = d*q + m (Q5_1, Q5_K)
  i8: signed 8-bit codes, per G-weight group a scale: w = d*q (Q8_0 and Q5_0 (q = its 5 bits - 16), G = 32;
      Q6_K, G = 16, q = its 6 bits - 32)
Rows come in tiles of TILE = 64 output rows: `qs[tile, group, j, r]` is byte j of row r's group, so the innermost
loop runs across a tile's 64 rows, contiguous in memory, and LLVM vectorises it (a loop over one row's blocks
does not: ~4x slower). Per format three kernels:
  *_matvec(..., x, t0, t1, out): one row x, tiles t0..t1 into out (their rows) (decode); the group's codes times x summed first, then scaled:
      out[r] = sum_g d[g,r] * (sum_j q[g,j,r] x[j]) + m[g,r] * (sum_j x[j])
  *_matmul(..., X, t0, t1, out): a few rows (a batched decode step): each group dequantised to float32 once, used by all
      rows, each row's group sum first (as *_matvec), vectorised across the tile's rows
  *_dequant(..., t0, t1, out): tiles t0..t1 as float32 (in_features, rows), for sgemm (prefill, big batches)
All arithmetic is float32; every kernel is compiled once and kept in numba's on-disk cache (cache=True), with
explicit signatures, so importing this module compiles (the first time) or loads them (every later time).
"""

from __future__ import annotations

import numpy as np
from numba import njit

TILE = 64

_NIB = "uint8[:, :, :, ::1], uint32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], boolean"
_I8 = "int8[:, :, :, ::1], float32[:, :, ::1]"
_VEC = "float32[::1], int64, int64, float32[::1]"
_MAT = "float32[:, ::1], int64, int64, float32[:, :]"
_DEQ = "int64, int64, float32[:, ::1]"
# One thread each (threads: weight_threads.py splits tiles between two callers); nogil so they run side by side.
_OPTIONS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
# The small-batch kernels may fuse a multiply and an add into one FMA (one rounding instead of two, so within the
# same bound): without it their arithmetic is a multiply and an add per weight and row
_BATCH_OPTIONS = dict(_OPTIONS, fastmath={"contract"})


@njit("float32[::1](float32[::1], int64)", cache=True, nogil=True)
def _group_sums(x, group):
    sums = np.zeros(x.size // group, np.float32)
    for g in range(sums.size):
        s = np.float32(0)
        for j in range(group):
            s += x[g * group + j]
        sums[g] = s
    return sums


@njit(cache=True, nogil=True, inline="always")
def _u4_dot(qs, t, g, x, s):
    """s[r] = sum over the group's 32 weights of code * x, for a tile's rows r (4-bit codes)."""
    for j in range(16):
        x0, x1 = x[g * 32 + j], x[g * 32 + 16 + j]
        for r in range(TILE):
            q = np.int32(qs[t, g, j, r])  # int32, not numba's int64: LLVM then converts 16 lanes at a time (2x)
            s[r] = s[r] + np.float32(np.int32(q & 15)) * x0 + np.float32(np.int32(q >> 4)) * x1


@njit(cache=True, nogil=True, inline="always")
def _u5_dot(qs, qh, t, g, x, s):
    """_u4_dot with each code's fifth bit from qh (bit j: weight j)."""
    for j in range(16):
        x0, x1 = x[g * 32 + j], x[g * 32 + 16 + j]
        for r in range(TILE):
            q, h = np.int32(qs[t, g, j, r]), np.int32(qh[t, g, r])
            lo = np.int32((q & 15) | (((h >> j) & 1) << 4))
            hi = np.int32((q >> 4) | (((h >> (j + 16)) & 1) << 4))
            s[r] = s[r] + np.float32(lo) * x0 + np.float32(hi) * x1


@njit(cache=True, nogil=True, inline="always")
def _nib_weights(qs, qh, d, m, high, t, g, w):
    """w (32, TILE) = the group's weights d * code + m, as float32 (one pass: a pass per step was slower)."""
    if high:
        for j in range(16):
            for r in range(TILE):
                q, h = np.int32(qs[t, g, j, r]), np.int32(qh[t, g, r])
                lo = np.int32((q & 15) | (((h >> j) & 1) << 4))
                hi = np.int32((q >> 4) | (((h >> (j + 16)) & 1) << 4))
                w[j, r] = d[t, g, r] * np.float32(lo) + m[t, g, r]
                w[j + 16, r] = d[t, g, r] * np.float32(hi) + m[t, g, r]
    else:
        for j in range(16):
            for r in range(TILE):
                q = np.int32(qs[t, g, j, r])
                w[j, r] = d[t, g, r] * np.float32(np.int32(q & 15)) + m[t, g, r]
                w[j + 16, r] = d[t, g, r] * np.float32(np.int32(q >> 4)) + m[t, g, r]


@njit(f"void({_NIB}, {_VEC})", **_OPTIONS)
def nib_matvec(qs, qh, d, m, high, x, t0, t1, out):
    groups = qs.shape[1]
    xs = _group_sums(x, 32)
    for t in range(t0, t1):
        acc = np.zeros(TILE, np.float32)
        s = np.empty(TILE, np.float32)
        for g in range(groups):
            s[:] = 0
            if high:
                _u5_dot(qs, qh, t, g, x, s)
            else:
                _u4_dot(qs, t, g, x, s)
            for r in range(TILE):
                acc[r] += d[t, g, r] * s[r] + m[t, g, r] * xs[g]
        out[(t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(f"void({_I8}, {_VEC})", **_OPTIONS)
def i8_matvec(qs, d, x, t0, t1, out):
    groups, size = qs.shape[1], qs.shape[2]
    for t in range(t0, t1):
        acc = np.zeros(TILE, np.float32)
        s = np.empty(TILE, np.float32)
        for g in range(groups):
            s[:] = 0
            for j in range(size):
                xj = x[g * size + j]
                for r in range(TILE):
                    s[r] += np.float32(qs[t, g, j, r]) * xj
            for r in range(TILE):
                acc[r] += d[t, g, r] * s[r]
        out[(t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(cache=True, nogil=True, inline="always")
def _accumulate32(w, X, column, acc):
    """acc[i, r] += sum_j w[j, r] * X[i, column + j] for one dequantised 32-weight group w (32, TILE): per row the
    group's sum first, as the matrix-vector kernel. The j loop has a literal trip count, so LLVM unrolls it and
    vectorises across r with the sum in a register (a j-then-r loop kept acc in memory: 1.6-1.8x slower)."""
    for i in range(X.shape[0]):
        for r in range(TILE):
            s = np.float32(0)
            for j in range(32):
                s += w[j, r] * X[i, column + j]
            acc[i, r] += s


@njit(cache=True, nogil=True, inline="always")
def _accumulate16(w, X, column, acc):
    """_accumulate32 for 16-weight groups (Q6_K)."""
    for i in range(X.shape[0]):
        for r in range(TILE):
            s = np.float32(0)
            for j in range(16):
                s += w[j, r] * X[i, column + j]
            acc[i, r] += s


@njit(f"void({_NIB}, {_MAT})", **_BATCH_OPTIONS)
def nib_matmul(qs, qh, d, m, high, X, t0, t1, out):
    for t in range(t0, t1):
        acc = np.zeros((X.shape[0], TILE), np.float32)
        w = np.empty((32, TILE), np.float32)
        for g in range(qs.shape[1]):
            _nib_weights(qs, qh, d, m, high, t, g, w)
            _accumulate32(w, X, g * 32, acc)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(f"void({_I8}, {_MAT})", **_BATCH_OPTIONS)
def i8_matmul(qs, d, X, t0, t1, out):
    groups, size = qs.shape[1], qs.shape[2]
    for t in range(t0, t1):
        acc = np.zeros((X.shape[0], TILE), np.float32)
        w = np.empty((size, TILE), np.float32)
        for g in range(groups):
            for j in range(size):
                for r in range(TILE):
                    w[j, r] = d[t, g, r] * np.float32(qs[t, g, j, r])
            if size == 32:
                _accumulate32(w, X, g * size, acc)
            else:
                _accumulate16(w, X, g * size, acc)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(f"void({_NIB}, {_DEQ})", **_OPTIONS)
def nib_dequant(qs, qh, d, m, high, t0, t1, out):
    w = np.empty((32, TILE), np.float32)
    for t in range(t0, t1):
        for g in range(qs.shape[1]):
            _nib_weights(qs, qh, d, m, high, t, g, w)
            out[g * 32:(g + 1) * 32, (t - t0) * TILE:(t - t0 + 1) * TILE] = w


@njit(f"void({_I8}, {_DEQ})", **_OPTIONS)
def i8_dequant(qs, d, t0, t1, out):
    groups, size = qs.shape[1], qs.shape[2]
    for t in range(t0, t1):
        c = (t - t0) * TILE
        for g in range(groups):
            for j in range(size):
                for r in range(TILE):
                    out[g * size + j, c + r] = d[t, g, r] * np.float32(qs[t, g, j, r])


KERNELS = {
    "u4": (nib_matvec, nib_matmul, nib_dequant),  # with high False (and a placeholder for qh)
    "u5": (nib_matvec, nib_matmul, nib_dequant),
    "i8": (i8_matvec, i8_matmul, i8_dequant),
}

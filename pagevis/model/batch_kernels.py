"""Several rows times the packed weights: the kernels of a batched decode step (2 to quantized.SMALL_BATCH rows).

A weight read once serves every row. Per tile of 64 output rows and group of G weights (32; Q6_K 16) the group's
codes are converted to float32 once, into a (G, 64) block that stays in L1, and each row's group sum is taken from it
as the matrix-vector kernel (weight_kernels.py) takes it for one row, factored the same way:
    out[i, r] = sum_g d[g, r] * (sum_j q[g, j, r] x[i, j]) + m[g, r] * (sum_j x[i, j])
so a batched row equals the one-row product within float32 rounding (FMA may fuse a multiply and an add). Rows go
through the code block two at a time: each code loaded from L1 feeds two rows' sums, held in registers across a
block of J codes (vectorised across the tile's 64 rows, J unrolled). Measured on SmolLM2's 576 x 3072 Q4_1 matrix
(one thread, Zen 5): 16 rows in 0.45 ms against the previous kernel's 0.54 (which dequantised d q + m into the
block first and fed one row per load); 4 to 8 rows per register block spilled or left the J loop rolled (slower).

At 16 rows this is the machine's float32 FMA rate (~60-65 GMAC/s here, OpenBLAS's sgemm of the same shape 45): the
product's 2 x weights x rows FLOPs, not its bytes, bound a batch; see docs/speed.md (batches) for what that allows.

Compiled on first use (~15-20 s of one core, under weight_kernels' compile lock) and kept in numba's on-disk cache
like weight_kernels.py's (then ~0.1 s to load).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagevis.model.weight_kernels import (_BATCH_OPTIONS, _I8, _MAT, _NIB, HALF, Q4_0, SUPER, _group_sums, _nib_scales,
                                         _scales)

TILE = 64
BLOCK = 8  # codes per register block: 8 and 16 measured alike (8 with the split chains ~10% faster), 4 slower,
# 32 left the loop rolled


@njit(cache=True, nogil=True, inline="always")
def _u4_codes(qs, t, g, c):
    for j in range(16):
        for r in range(TILE):
            q = np.int32(qs[t, g, j, r])
            c[j, r] = np.float32(np.int32(q & 15))
            c[j + 16, r] = np.float32(np.int32(q >> 4))


@njit(cache=True, nogil=True, inline="always")
def _i8_codes(qs, t, g, c):
    for j in range(qs.shape[2]):
        for r in range(TILE):
            c[j, r] = np.float32(qs[t, g, j, r])


@njit(cache=True, nogil=True, inline="always")
def _pair_sums(c, size, X, i, column, s):
    """s[0], s[1] (TILE each) = the group's codes c (size, TILE) times rows i and i + 1 of X; each row's sum in two
    chains (even and odd codes), so four FMA chains are in flight, not two (8 rows: ~10% faster)."""
    s[:] = 0
    for j0 in range(0, size, BLOCK):
        for r in range(TILE):
            even0, even1, odd0, odd1 = s[0, r], s[1, r], np.float32(0), np.float32(0)
            for j in range(0, BLOCK, 2):
                code, next_code = c[j0 + j, r], c[j0 + j + 1, r]
                even0 += code * X[i, column + j0 + j]
                even1 += code * X[i + 1, column + j0 + j]
                odd0 += next_code * X[i, column + j0 + j + 1]
                odd1 += next_code * X[i + 1, column + j0 + j + 1]
            s[0, r] = even0 + odd0
            s[1, r] = even1 + odd1


@njit(cache=True, nogil=True, inline="always")
def _row_sums(c, size, X, i, column, s):
    """s[0] = the group's codes times row i of X (an odd batch's last row)."""
    s[0] = 0
    for j0 in range(0, size, BLOCK):
        for r in range(TILE):
            s0 = s[0, r]
            for j in range(BLOCK):
                s0 += c[j0 + j, r] * X[i, column + j0 + j]
            s[0, r] = s0


@njit(cache=True, nogil=True, inline="always")
def _scaled(s, k, d, m, xsum, acc, i):
    """acc[i] += d * s[k] + m * xsum (xsum: row i's group sum; m is 0 for a format without offsets)."""
    for r in range(TILE):
        acc[i, r] += d[r] * s[k, r] + m[r] * xsum


@njit(cache=True, nogil=True, inline="always")
def _group_products(c, size, X, column, s, d, m, xs, g, acc):
    """acc[i] += d * (codes . row i) + m * row i's group sum, for every row i of X, two rows at a time.
    (Measured: an offset flag tested here, or a for loop over the pairs, made 2 rows ~1.3x slower.)"""
    n = X.shape[0]
    i = 0
    while i + 2 <= n:
        _pair_sums(c, size, X, i, column, s)
        for k in range(2):
            _scaled(s, k, d, m, xs[i + k, g], acc, i + k)
        i += 2
    while i < n:
        _row_sums(c, size, X, i, column, s)
        _scaled(s, 0, d, m, xs[i, g], acc, i)
        i += 1


@njit(cache=True, nogil=True, inline="always")
def _u4_rows_tiles(qs, dh, ds, mh, ms, per, mode, X, t0, t1, out):
    n = X.shape[0]
    xs = np.empty((n, qs.shape[1]), np.float32)
    for i in range(n):
        xs[i] = _group_sums(X[i], 32)
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    c, s, acc = np.empty((32, TILE), np.float32), np.empty((2, TILE), np.float32), np.empty((n, TILE), np.float32)
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(qs.shape[1]):
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            _u4_codes(qs, t, g, c)
            _group_products(c, 32, X, g * 32, s, d, m, xs, g, acc)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(cache=True, nogil=True, inline="always")
def _i8_rows_tiles(qs, dh, ds, per, size, X, t0, t1, out):
    n = X.shape[0]
    d, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    no_offsets, no_sums = np.zeros(TILE, np.float32), np.zeros((n, 1), np.float32)  # d s + 0 * 0: exactly d s
    c, s, acc = np.empty((size, TILE), np.float32), np.empty((2, TILE), np.float32), np.empty((n, TILE), np.float32)
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(qs.shape[1]):
            _scales(dh, ds, per, t, g, d, sup)
            _i8_codes(qs, t, g, c)
            _group_products(c, size, X, g * size, s, d, no_offsets, no_sums, 0, acc)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


def _u4_rows(qs, qh, dh, ds, mh, ms, high, per, mode, X, t0, t1, out):
    """One copy per type with its flags literal, as weight_kernels' kernels: the scales' type read at run time
    (one copy for all) made 2 rows ~1.6x slower, 16 rows ~1.1x."""
    if per > 1:  # Q4_K
        _u4_rows_tiles(qs, dh, ds, mh, ms, 8, SUPER, X, t0, t1, out)
    elif mode == Q4_0:
        _u4_rows_tiles(qs, dh, ds, mh, ms, 1, Q4_0, X, t0, t1, out)
    else:  # Q4_1
        _u4_rows_tiles(qs, dh, ds, mh, ms, 1, HALF, X, t0, t1, out)


def _i8_rows(qs, dh, ds, per, X, t0, t1, out):
    if per > 1:  # Q6_K: groups of 16, 16 a super-block
        _i8_rows_tiles(qs, dh, ds, 16, 16, X, t0, t1, out)
    else:  # Q8_0, Q5_0
        _i8_rows_tiles(qs, dh, ds, 1, 32, X, t0, t1, out)


def compiled(cache: bool = True) -> dict:
    """The row kernels by packed format, for quantized.QuantMatrix.product's 2 to SMALL_BATCH rows (it calls this
    once, under weight_kernels' compile lock, after loading those): compiled, or loaded from numba's on-disk cache
    (cache); a cache numba cannot use (damaged files, no writable folder) falls back to compiling in memory. u4
    (Q4_0, Q4_1, Q4_K) and i8 (Q8_0, Q5_0, Q6_K): the types SmolLM2's and Gemma 3's files hold; u5 (Q5_1, Q5_K)
    keeps weight_kernels' small-batch kernel (its 2 copies here would cost ~8 s more of first compile)."""
    def compile_all(options) -> dict:
        return {"u4": njit(f"void({_NIB}, {_MAT})", **options)(_u4_rows),
                "i8": njit(f"void({_I8}, {_MAT})", **options)(_i8_rows)}

    if cache:
        try:
            return compile_all(_BATCH_OPTIONS)
        except Exception:  # numba's cache: unpickling a damaged file, "no locator available", ...
            pass
    return compile_all({**_BATCH_OPTIONS, "cache": False})

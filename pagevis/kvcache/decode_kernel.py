"""Decode attention in one numba call per layer: one query token, every head, K/V read where they lie.

`attend_one(q, scale, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window, out, weights)`:
  q (n_heads, d) float32, scaled here by `scale` (1/sqrt(d)); k, v (n_kv, S, d) float32 (or float16's bits: below),
  C-contiguous: the pool's frames as one array (a page-store's (n_kv, pages, page_size, d) reshaped, free), of which
  the first n_keys slots are read; with slot >= 0, the new token's k_new, v_new (n_kv, d) are written into that slot first (a
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

`attend_split(..., pool)`: attend_one's result with the keys cut into PARTS fixed ranges (PART_ALIGN keys aligned)
shared with the weights' spin pool's helper thread (two weight threads: the pool handed in by the engine, through
paged_attention.share_pool; its `items`, each part one item): a part's scores, their max, the exponentials, their sum
and the values weighted by them (flash-decoding's partials, `_part`) computed whole by one thread, then merged by the
caller in part order (`_merge`: each part's share exp(max_p - max) / total, applied to its weights and values). A
part is the same bits whichever thread computes it (the helper into the pool's scratch, copied in; one the helper is
late on the caller computes again); the weights are divided by the sum after the values are weighted, not before:
within float32 rounding of attend_one's. Below SPLIT_KEYS keys, attend_one (a split's fixed cost, ~6-8 us a call,
outweighs half the keys' read).

Float16 pages are read and written in place too, through their uint16 views (`bits`: numba has no float16 on the
CPU): each element widened to float32 exactly where it is loaded (kernel_intrinsics.widen: integer operations and one
product, vectorised), the new token rounded as NumPy's astype(float16) rounds (kernel_intrinsics.half_bits); all
arithmetic float32, as over float32 pages (`Kernels`: FLOAT32, half_kernels).

Compiled once with an explicit signature and kept in numba's on-disk cache (cache=True), as the weight kernels
are (model/weight_kernels.py); this module is imported on the first decode step that uses it (engine.py loads it
before, attention_kernels.load_decode_kernel); float16's kernels the first time a float16 store decodes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from numba import carray, cfunc, njit, types

from pagevis.kernel_intrinsics import exp_in_range, narrow, pointer_to, prefetch, widen
from pagevis.kernel_loader import import_kernels

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
def _ask_ahead(array, h, t, n_rows, end):  # pragma: no cover (numba)
    """The cache lines PREFETCH_AHEAD bytes past rows t .. t + n_rows of array[h], asked for, short of row end (a
    part's keys end there: the other thread reads on)."""
    row_bytes = array.shape[2] * array.itemsize
    base = array.ctypes.data + h * array.shape[1] * row_bytes
    at = base + t * row_bytes + PREFETCH_AHEAD
    for line in range(at, min(at + n_rows * row_bytes, base + end * row_bytes), 64):
        prefetch(line)


@njit(cache=True, nogil=True, inline="always")
def _ask_starts(array, lo, hi):  # pragma: no cover (numba)
    """The first PREFETCH_AHEAD bytes of every head's rows lo .. hi of array, asked for at once: the sweeps ask
    ahead only of where they read, and a stream's start from memory, one line after another, cost more than the
    kernel's arithmetic when there are few keys (measured: a call after 23 tokens, 13 us against 4 warm)."""
    row_bytes = array.shape[2] * array.itemsize
    for h in range(array.shape[0]):
        at = array.ctypes.data + (h * array.shape[1] + lo) * row_bytes
        for b in range(0, min((hi - lo) * row_bytes, PREFETCH_AHEAD), 64):
            prefetch(at + b)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _exp(x):  # pragma: no cover (numba)
    """exp(x) for x <= 0 in float32 (kernel_intrinsics.exp_in_range); exactly 0 below EXP_FLOOR and for -inf."""
    p = exp_in_range(max(x, EXP_FLOOR))
    return p if x >= EXP_FLOOR else np.float32(0)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _scores(q, k, h, first, rows, lo, hi, weights):  # pragma: no cover (numba)
    """weights[first + i, t - lo] = q[first + i] . k[h, t] for the chunk's rows and keys lo .. hi, two at a time."""
    d = q.shape[1]
    last = first + rows - 1
    q0, q1, q2, q3 = q[first], q[min(first + 1, last)], q[min(first + 2, last)], q[min(first + 3, last)]
    body = lo + (hi - lo) // 2 * 2
    for t in range(lo, body, 2):
        r0, r1 = k[h, t], k[h, t + 1]
        _ask_ahead(k, h, t, 2, hi)
        s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0)
        for j in range(d):
            x, y = widen(r0[j]), widen(r1[j])
            s00 += q0[j] * x
            s01 += q0[j] * y
            s10 += q1[j] * x
            s11 += q1[j] * y
            s20 += q2[j] * x
            s21 += q2[j] * y
            s30 += q3[j] * x
            s31 += q3[j] * y
        c = t - lo
        weights[first, c], weights[first, c + 1] = s00, s01
        if rows > 1:
            weights[first + 1, c], weights[first + 1, c + 1] = s10, s11
        if rows > 2:
            weights[first + 2, c], weights[first + 2, c + 1] = s20, s21
        if rows > 3:
            weights[first + 3, c], weights[first + 3, c + 1] = s30, s31
    for t in range(body, hi):
        for g in range(first, first + rows):
            s = np.float32(0)
            for j in range(d):
                s += q[g, j] * widen(k[h, t, j])
            weights[g, t - lo] = s


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _hide(row, h, lo, hi, bias, key_positions, position, window):  # pragma: no cover (numba)
    """Keys lo .. hi's scores in row (row[t - lo]): the bias added (bias's row h, or its only row; none if it has no
    row), and with window > 0 the keys at or below position - window or after it set to -inf."""
    if bias.shape[0] > 0:
        head_bias = bias[h if bias.shape[0] > 1 else 0]
        for t in range(lo, hi):
            row[t - lo] += head_bias[t]
    if window > 0:
        for t in range(lo, hi):
            if key_positions[t] <= position - window or key_positions[t] > position:
                row[t - lo] = -np.inf


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _exps(row, n_keys):  # pragma: no cover (numba)
    """row[:n_keys] = exp(row - its max), in place: (the max, the sum of the exponentials); a row with no visible
    key (all -inf) into zeros: (-inf, 0)."""
    peak = np.float32(-np.inf)
    for t in range(n_keys):
        peak = max(peak, row[t])
    if peak == -np.inf:
        row[:n_keys] = 0
        return peak, np.float32(0)
    total = np.float32(0)
    for t in range(n_keys):
        e = _exp(row[t] - peak)
        row[t] = e
        total += e
    return peak, total


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _softmax(weights, g, n_keys):  # pragma: no cover (numba)
    """Row g of the scores into weights, in place; a row with no visible key (all -inf) into zeros. Whether it
    had one."""
    row = weights[g]
    peak, total = _exps(row, n_keys)
    if peak == -np.inf:
        return False
    inverse = np.float32(1) / total
    for t in range(n_keys):
        row[t] *= inverse
    return True


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _values(weights, v, h, first, rows, lo, hi, acc):  # pragma: no cover (numba)
    """acc[i] = sum over t in lo .. hi of weights[first + i, t - lo] v[h, t] for the chunk's rows (acc: ROWS
    distinct rows, so the compiler sees four outputs that do not overlap), four keys at a time."""
    d = v.shape[2]
    last = first + rows - 1
    w0, w1, w2, w3 = weights[first], weights[min(first + 1, last)], weights[min(first + 2, last)], weights[
        min(first + 3, last)]
    o0, o1, o2, o3 = acc[0], acc[1], acc[2], acc[3]
    acc[:, :d] = 0
    body = lo + (hi - lo) // 4 * 4
    for t in range(lo, body, 4):
        r0, r1, r2, r3 = v[h, t], v[h, t + 1], v[h, t + 2], v[h, t + 3]
        _ask_ahead(v, h, t, 4, hi)
        c = t - lo
        a0, a1, a2, a3 = w0[c], w0[c + 1], w0[c + 2], w0[c + 3]
        b0, b1, b2, b3 = w1[c], w1[c + 1], w1[c + 2], w1[c + 3]
        c0, c1, c2, c3 = w2[c], w2[c + 1], w2[c + 2], w2[c + 3]
        e0, e1, e2, e3 = w3[c], w3[c + 1], w3[c + 2], w3[c + 3]
        for j in range(d):
            x0, x1, x2, x3 = widen(r0[j]), widen(r1[j]), widen(r2[j]), widen(r3[j])
            o0[j] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
            o1[j] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
            o2[j] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
            o3[j] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
    for t in range(body, hi):
        for i in range(rows):
            w = weights[first + i, t - lo]
            for j in range(d):
                acc[i, j] += w * widen(v[h, t, j])


@njit(cache=True, nogil=True, inline="always")
def _write_slot(k, v, slot, k_new, v_new):  # pragma: no cover (numba)
    """With slot >= 0, the new token's K/V (n_kv, d) float32 into that slot of k, v (n_kv, S, d), rounded to their
    element (narrow: float16 pages round as NumPy does). Loops: a slice assignment compiles numba's shape-mismatch
    error path (a second or two of a first launch each)."""
    if slot >= 0:
        for h in range(k.shape[0]):
            for j in range(k.shape[2]):
                k[h, slot, j] = narrow(k_new[h, j], k)
                v[h, slot, j] = narrow(v_new[h, j], v)


@njit(cache=True, nogil=True, inline="always")
def _scaled(q, scale, query):  # pragma: no cover (numba)
    """query = q * scale, one float32 product an element (NumPy's)."""
    for g in range(q.shape[0]):
        for j in range(q.shape[1]):
            query[g, j] = q[g, j] * scale


@njit(cache=True, nogil=True, inline="always")
def _rows_out(acc, rows, out, first):  # pragma: no cover (numba)
    """out[first + i] = acc[i] for the chunk's rows (a loop: see _write_slot)."""
    for i in range(rows):
        for j in range(out.shape[1]):
            out[first + i, j] = acc[i, j]


@njit(_SIGNATURE, cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def attend_one(q, scale, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window, out,
               weights):  # pragma: no cover (numba)
    n_heads, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    _write_slot(k, v, slot, k_new, v_new)
    _ask_starts(k, 0, n_keys)
    _ask_starts(v, 0, n_keys)
    query = np.empty((n_heads, d), np.float32)
    _scaled(q, scale, query)
    acc = np.empty((ROWS, d), np.float32)
    for h in range(n_kv):
        for first in range(h * group, (h + 1) * group, ROWS):
            rows = min(ROWS, (h + 1) * group - first)
            _scores(query, k, h, first, rows, 0, n_keys, weights)
            for g in range(first, first + rows):
                _hide(weights[g], h, 0, n_keys, bias, key_positions, position, window)
                _softmax(weights, g, n_keys)
            _values(weights, v, h, first, rows, 0, n_keys, acc)
            _rows_out(acc, rows, out, first)


NO_BIAS = np.zeros((0, 0), np.float32)
NO_POSITIONS = np.zeros(0, np.int64)
NO_ROW = np.zeros((0, 0), np.float32)  # k_new, v_new when nothing is written (slot -1)

# A lone sequence's decode attention split over the weights' two threads (attend_split): the keys cut into parts
# of PART_ALIGN-aligned ranges, each part's attention computed whole by one thread (its scores, their max, the
# exponentials and their sum, the values weighted by them: flash-decoding's partials), merged by the caller.
# model/spin_pool.py's, which the cache cannot import (tests/test_decode_split.py checks they agree): a part's
# partial is a whole number of TILE floats, one item of the pool's job, whose word TILES_WORD counts the job's tiles
# (its descriptor: DESCRIPTOR words)
TILE, DESCRIPTOR, TILES_WORD = 64, 36, 4
# fewer keys than this: attend_one on the caller. Measured (one layer, cold K/V, the helper spinning, load ~1.6),
# attend_one / two parts / four parts in us: SmolLM2's shape at 128 keys 20.1 / 23.7 / 27.6, 256 38.4 / 33.8 / 37.3,
# 512 73.3 / 58.6 / 68.0, 4096 711 / 430 / 448; Gemma 3's (one KV head of 256) at 128 25.6 / 25.1 / 27.9, 256
# 54.2 / 40.5 / 43.4, 512 111 / 71 / 72, 4096 839 / 509 / 507. A helper that is not running (its core busy
# elsewhere) costs the caller ~10 % more than attend_one: the line is where two threads clearly win
SPLIT_KEYS = 256
PARTS = 2  # parts a split cuts the keys into (four: no faster with two threads, more to merge)
PART_ALIGN = 16
# pool_kernel's handle: the shapes, then the arrays' addresses
HEADS, DIM, N_KV, SLOTS, N_KEYS, PART, BIAS_ROWS, BIAS_COLS, N_POSITIONS, POSITION, WINDOW, BLOCK = range(12)
QUERY, K, V, BIAS, KEY_POSITIONS = range(12, 17)
HANDLE = 17


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def _part(q, k, v, lo, hi, bias, key_positions, position, window, out, peaks, totals,
          weights):  # pragma: no cover (numba)
    """Keys lo .. hi of every head (q scaled already): weights[g, :hi - lo] = exp(score - peaks[g]) (with the bias
    and the window's -inf), totals[g] their sum, out[g] the values weighted by them (not divided by the sum). A
    function of its own (not inlined into pool_kernel: the C function's loops came out ~40 % slower), compiled for the
    element type of the pages its pool kernel reads (float32, or float16's bits)."""
    n_heads, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    _ask_starts(k, lo, hi)
    _ask_starts(v, lo, hi)
    acc = np.empty((ROWS, d), np.float32)
    for h in range(n_kv):
        for first in range(h * group, (h + 1) * group, ROWS):
            rows = min(ROWS, (h + 1) * group - first)
            _scores(q, k, h, first, rows, lo, hi, weights)
            for g in range(first, first + rows):
                _hide(weights[g], h, lo, hi, bias, key_positions, position, window)
                peaks[g], totals[g] = _exps(weights[g], hi - lo)
            _values(weights, v, h, first, rows, lo, hi, acc)
            _rows_out(acc, rows, out, first)


_i64, _f32, _u16 = pointer_to(types.int64), pointer_to(types.float32), pointer_to(types.uint16)
_POOL_SIGNATURE = types.void(*(types.int64,) * 7)


@njit(cache=True, nogil=True, inline="always")
def _parts(h, k, v, t0, t1, target):  # pragma: no cover (numba)
    """pool_kernel's work, k and v (n_kv, slots, d) read from the handle h by the caller (float32 or float16's bits)."""
    n_heads, d, n_keys, part, block = h[HEADS], h[DIM], h[N_KEYS], h[PART], h[BLOCK]
    q = carray(_f32(h[QUERY]), (n_heads, d))
    bias = carray(_f32(h[BIAS]), (h[BIAS_ROWS], h[BIAS_COLS]))
    key_positions = carray(_i64(h[KEY_POSITIONS]), (h[N_POSITIONS],))
    for p in range(t0 * TILE // block, t1 * TILE // block):
        at_part = target + 4 * p * block
        lo = p * part
        _part(q, k, v, lo, min(n_keys, lo + part), bias, key_positions, h[POSITION], h[WINDOW],
              carray(_f32(at_part), (n_heads, d)), carray(_f32(at_part + 4 * n_heads * d), (n_heads,)),
              carray(_f32(at_part + 4 * n_heads * (d + 1)), (n_heads,)),
              carray(_f32(at_part + 4 * n_heads * (d + 2)), (n_heads, part)))


@cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
def pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
    """Tiles t0..t1 of the partials at target, whole parts (`_part`) of the handle at address at: spin_pool's
    rows-kernel signature (job, n and stride unused), so the pool's two threads share a layer's parts. A part's
    partial: its output (n_heads, d), max (n_heads), sum (n_heads), then its weights (n_heads, PART)."""
    h = carray(_i64(at), (HANDLE,))
    shape = (h[N_KV], h[SLOTS], h[DIM])
    _parts(h, carray(_f32(h[K]), shape), carray(_f32(h[V]), shape), t0, t1, target)


_POOL_KERNEL = int(pool_kernel.address or 0)


_PREPARE_SIGNATURE = ("void(int64[::1], float32[:, ::1], float32, float32[:, ::1], float32[:, :, ::1], "
                      "float32[:, :, ::1], int64, float32[:, ::1], float32[:, ::1], int64, float32[:, ::1], int64[::1], "
                      "int64, int64, int64, int64)")


@njit(_PREPARE_SIGNATURE, cache=True, nogil=True, boundscheck=False)
def _prepare(handle, q, scale, query, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window, part,
             block):  # pragma: no cover (numba)
    """The new token's K/V written into its slot (slot >= 0), query = q * scale (attend_one's product), and
    pool_kernel's handle of the arrays (their addresses read in numba: NumPy's ctypes attribute costs ~2 us)."""
    _write_slot(k, v, slot, k_new, v_new)
    _scaled(q, scale, query)
    handle[HEADS], handle[DIM] = q.shape
    handle[N_KV], handle[SLOTS], handle[N_KEYS], handle[PART] = k.shape[0], k.shape[1], n_keys, part
    handle[BIAS_ROWS], handle[BIAS_COLS], handle[N_POSITIONS] = bias.shape[0], bias.shape[1], key_positions.size
    handle[POSITION], handle[WINDOW], handle[BLOCK] = position, window, block
    handle[QUERY], handle[K], handle[V] = query.ctypes.data, k.ctypes.data, v.ctypes.data
    handle[BIAS], handle[KEY_POSITIONS] = bias.ctypes.data, key_positions.ctypes.data


@njit("void(float32[:, ::1], int64, int64, float32[:, ::1], float32[:, ::1])", cache=True, nogil=True,
      fastmath=_FAST, error_model="numpy", boundscheck=False)
def _merge(partials, n_keys, part, out, weights):  # pragma: no cover (numba)
    """out and weights (n_heads, n_keys), normalised, from the parts' partials (pool_kernel's layout), in part
    order: m = the parts' largest max; each part's share exp(m_p - m) / sum over parts of l_p exp(m_p - m)."""
    n_heads, d = out.shape
    count = partials.shape[0]
    at_peak, at_total, at_weights = n_heads * d, n_heads * (d + 1), n_heads * (d + 2)
    factor = np.empty(count, np.float32)
    for g in range(n_heads):
        peak = np.float32(-np.inf)
        for p in range(count):
            peak = max(peak, partials[p, at_peak + g])
        row = weights[g]
        if peak == -np.inf:
            out[g] = 0
            row[:n_keys] = 0
            continue
        total = np.float32(0)
        for p in range(count):
            factor[p] = _exp(partials[p, at_peak + g] - peak)
            total += partials[p, at_total + g] * factor[p]
        inverse = np.float32(1) / total
        mixed = out[g]
        mixed[:] = 0
        for p in range(count):
            share = factor[p] * inverse
            for j in range(d):
                mixed[j] += partials[p, g * d + j] * share
            lo = p * part
            first = at_weights + g * part
            for c in range(min(n_keys, lo + part) - lo):
                row[lo + c] = partials[p, first + c] * share


@lru_cache(maxsize=64)
def _job(tiles: int) -> np.ndarray:
    job = np.zeros(DESCRIPTOR, np.int64)
    job[TILES_WORD] = tiles
    return job


class Kernels(NamedTuple):
    """attend_one, _prepare and pool_kernel's address for one element type of the pages: FLOAT32's, or float16's read
    through their bits (uint16 views: half_kernels)."""
    attend_one: Any
    prepare: Any
    pool_kernel: int


FLOAT32 = Kernels(attend_one, _prepare, _POOL_KERNEL)


def half_kernels() -> Kernels:
    """The kernels of float16 pages (k, v passed as their uint16 views: `bits`), compiled or loaded from numba's cache
    the first time a float16 store decodes (through kernel_loader.import_kernels: under the compile lock), not when
    this module is: a float32 cache's first launch never compiles them."""
    return import_kernels(__name__, "the decode attention kernel (float16 pages)", part="float16",
                          build=lambda module: module.build_half_kernels())


def build_half_kernels() -> Kernels:
    """half_kernels' compile: the same Python functions with uint16 K/V (numba's cache keeps them beside float32's)."""
    signature, prepare = (text.replace("float32[:, :, ::1], float32[:, :, ::1]", "uint16[:, :, ::1], uint16[:, :, ::1]")
                          for text in (_SIGNATURE, _PREPARE_SIGNATURE))

    @cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
    def half_pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
        h = carray(_i64(at), (HANDLE,))
        shape = (h[N_KV], h[SLOTS], h[DIM])
        _parts(h, carray(_u16(h[K]), shape), carray(_u16(h[V]), shape), t0, t1, target)

    return Kernels(njit(signature, cache=True, nogil=True, fastmath=_FAST, error_model="numpy",
                        boundscheck=False)(attend_one.py_func),
                   njit(prepare, cache=True, nogil=True, boundscheck=False)(_prepare.py_func),
                   int(half_pool_kernel.address or 0))


def bits(array: np.ndarray) -> np.ndarray:
    """K or V as the kernels read them: float32 itself, float16 as its uint16 view (numba has no float16 on the CPU)."""
    return array if array.dtype == np.float32 else array.view(np.uint16)


def attend_split(q: np.ndarray, scale: np.float32, k: np.ndarray, v: np.ndarray, slot: int, k_new: np.ndarray,
                 v_new: np.ndarray, n_keys: int, bias: np.ndarray, key_positions: np.ndarray, position: int,
                 window: int, out: np.ndarray, weights: np.ndarray, pool: Any, parts: int = PARTS,
                 kernels: Kernels = FLOAT32) -> None:
    """attend_one's result (its arguments, the same meaning), the keys cut into `parts` parts of fixed ranges shared
    with the spin pool's helper thread (pool: model/spin_pool.py's, handed in: SpinPool.items), each part computed
    whole by one thread (the helper's into its scratch, copied in; one it is late on computed by the caller): the
    same bits whoever computes a part, within float32 rounding of attend_one's (the weights divided by the sum
    after the values, not before). kernels: those of the pages' element type (k, v float32, or uint16: float16's
    bits, half_kernels)."""
    n_heads, d = q.shape
    part = -(-n_keys // parts // PART_ALIGN) * PART_ALIGN if n_keys > parts * PART_ALIGN else -(-n_keys // parts)
    count = -(-n_keys // part)
    tiles = -(-n_heads * (d + 2 + part) // TILE)
    partials = np.empty((count, tiles * TILE), np.float32)
    query = np.empty((n_heads, d), np.float32)
    handle = np.empty(HANDLE, np.int64)
    kernels.prepare(handle, q, scale, query, k, v, slot, k_new, v_new, n_keys, bias, key_positions, position, window,
                    part, tiles * TILE)
    pool.items(kernels.pool_kernel, _job(count * tiles), handle, (query, k, v, bias, key_positions), partials.reshape(-1),
               count)
    _merge(partials, n_keys, part, out, weights)

"""Attention of several sequences' chunks of queries in one numba call per layer, each over its own pages, read where
they lie: batch_decode_kernel's `attend_tables` for n_i >= 1 queries a sequence (a step's prompt chunks, with the
one-token decode rows of other sequences beside them).

`attend_chunks(q, k, v, tables, n_pages, bias, key_positions, positions, starts, window, pool, wanted)`: the queries
of B sequences one after another (q: (N, n_heads, d); sequence b's rows starts[b] .. starts[b + 1], at positions
(N,)), the pool's K and V as the page store holds them ((n_kv, pages, page_size, d) float32 or float16), each
sequence's block table (tables: (B, widest) page ids, row b's first n_pages[b] used), the pool's occupancy bias per
flat slot (page * page_size + slot: 0 resident, -inf empty) and each slot's position: a query at position p sees the
resident keys at positions <= p (the causal mask), and with window > 0 only those above p - window. Returns every
row's output (N, n_heads, d) and the weights of the last row of each sequence in `wanted` (all by default) over its
table's flat slots (len(wanted), n_heads, widest * page_size), normalised, exactly 0 on hidden slots and padding; a
row with no visible key gets zeros. What `attention_kernels.attend` computes over each sequence's gathered pages
(paged_attention.attend's gathered path), without the gather, the masks' arrays or a call a sequence.

The rows are cut into items of ROWS consecutive rows (the last may be short; an item may hold the rows of several
sequences), each computed whole by `_items`: per sequence and KV head, the group's query heads of the item's rows
against the sequence's keys, transposed once into a (d, keys) buffer (float16 widened there), so the scores are sweeps
over the keys (the vector lanes), four query rows sharing each load and four dimensions each score's load and store;
then the mask and batch_decode_kernel's softmax a row (`_normalise`), then the values a page at a time, each row's sums
in registers (kernel_intrinsics.weigh_rows, as batch_decode_kernel's lanes path). A page's slots above its last resident
one are neither read nor multiplied. Each row's arithmetic is its own, the items' bounds fixed by the rows alone, so the
same inputs give the same bits however the items are split among threads: with the weights' spin pool (two weight
threads, paged_attention.share_pool) the items are shared with its helper thread, one a chunk (SpinPool.items, calling
`pool_kernel` through its address), the helper writing only into the pool's scratch, as batch_decode_kernel's sequences
are. The last rows' weights of `wanted` are computed again on the caller's thread (`_last_rows`: a row alone, the same
code), only when asked (a watched layer).
Query head h reads KV head h // group; sums in any order within a row (fastmath reassoc), so results agree with
attention_kernels.attend and with float64 within float32 rounding.
Float16 pages are read through their uint16 views (`Kernels`: FLOAT32, and half_kernels, compiled the first time a
float16 store needs them). Compiled once and kept in numba's on-disk cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import carray, cfunc, njit, types

from pagevis.kernel_intrinsics import pointer_to, weigh_rows, widen
from pagevis.kernel_loader import import_kernels
from pagevis.kvcache.batch_decode_kernel import LANES, TILE, _job, _normalise, _page_rows, _page_values
from pagevis.kvcache.decode_kernel import bits

_FAST = {"reassoc", "contract"}
HIDDEN, MIN_POSITION = np.iinfo(np.int64).max, np.iinfo(np.int64).min  # an empty slot's position; no window's floor
ROWS = 16  # rows an item (spin_pool.MAX_CHUNKS items at most are shared: 4,096 rows)
_SIGNATURE = ("void(float32[:, :, ::1], float32, float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], "
              "int64[::1], float32[::1], int64[::1], int64[::1], int64[::1], int64, float32[:, ::1], int64, int64)")
_LAST_SIGNATURE = ("void(float32[:, :, ::1], float32, float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], "
                   "int64[::1], float32[::1], int64[::1], int64[::1], int64[::1], int64, int64[::1], "
                   "float32[:, :, ::1])")
# pool_kernel's handle: the shapes, then the arrays' addresses
N_ROWS, HEADS, DIM, N_KV, PAGES, PAGE_SIZE, BATCH, WIDEST, SLOTS, WINDOW, ITEM_TILES, N_KEY_POSITIONS, SCALE = range(13)
Q, K, V, TABLES, N_PAGES, BIAS, KEY_POSITIONS, POSITIONS, STARTS = range(13, 22)
HANDLE = 22
NO_WEIGHTS = np.zeros((0, 1, 1), np.float32)


@njit(cache=True, nogil=True, inline="always", boundscheck=False)
def _transposed(k, h, table, used, tops, kt):  # pragma: no cover (numba)
    """kt[j, p * page_size + s] = KV head h's key at slot s of the table's page p (float32, float16 widened) for the
    slots below each page's top, 0 above (never read: their scores are set to -inf)."""
    ps, d = k.shape[2], k.shape[3]
    for p in range(used):
        page, at = table[p], p * ps
        for s in range(tops[p]):
            for j in range(d):
                kt[j, at + s] = widen(k[h, page, s, j])
        for s in range(tops[p], ps):
            for j in range(d):
                kt[j, at + s] = 0


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _scores(query, nq, kt, n, scores):  # pragma: no cover (numba)
    """scores[i, :n] = query[i] . kt[:, :n] for rows i < nq: four rows at a time sharing each load of kt's rows, four
    dimensions a sweep over the keys (each score loaded and stored once for four products, not once a product)."""
    d = kt.shape[0]
    body, dims = nq // 4 * 4, d // 4 * 4
    for i in range(0, body, 4):
        w0, w1, w2, w3 = scores[i], scores[i + 1], scores[i + 2], scores[i + 3]
        q0, q1, q2, q3 = query[i], query[i + 1], query[i + 2], query[i + 3]
        w0[:n] = 0
        w1[:n] = 0
        w2[:n] = 0
        w3[:n] = 0
        for j in range(0, dims, 4):
            k0, k1, k2, k3 = kt[j], kt[j + 1], kt[j + 2], kt[j + 3]
            a0, a1, a2, a3 = q0[j], q0[j + 1], q0[j + 2], q0[j + 3]
            b0, b1, b2, b3 = q1[j], q1[j + 1], q1[j + 2], q1[j + 3]
            c0, c1, c2, c3 = q2[j], q2[j + 1], q2[j + 2], q2[j + 3]
            e0, e1, e2, e3 = q3[j], q3[j + 1], q3[j + 2], q3[j + 3]
            for t in range(n):
                x0, x1, x2, x3 = k0[t], k1[t], k2[t], k3[t]
                w0[t] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                w1[t] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                w2[t] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                w3[t] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
        for j in range(dims, d):
            row, a, b, c, e = kt[j], q0[j], q1[j], q2[j], q3[j]
            for t in range(n):
                w0[t] += a * row[t]
                w1[t] += b * row[t]
                w2[t] += c * row[t]
                w3[t] += e * row[t]
    for i in range(body, nq):
        w, x = scores[i], query[i]
        w[:n] = 0
        for j in range(0, dims, 4):
            k0, k1, k2, k3 = kt[j], kt[j + 1], kt[j + 2], kt[j + 3]
            a0, a1, a2, a3 = x[j], x[j + 1], x[j + 2], x[j + 3]
            for t in range(n):
                w[t] += a0 * k0[t] + a1 * k1[t] + a2 * k2[t] + a3 * k3[t]
        for j in range(dims, d):
            row, a = kt[j], x[j]
            for t in range(n):
                w[t] += a * row[t]


@njit(cache=True, nogil=True, inline="always", boundscheck=False)
def _gather_keys(table, used, tops, ps, bias, key_positions, kpos, kbias):  # pragma: no cover (numba)
    """kpos[t], kbias[t]: the position and occupancy bias of the table's flat slot t (its page p = t // page_size):
    HIDDEN's position on an empty slot (bias -inf) and above each page's top, so the causal test hides it."""
    for p in range(used):
        base, at = table[p] * ps, p * ps
        for s in range(ps):
            b = bias[base + s] if s < tops[p] else -np.inf
            kpos[at + s] = key_positions[base + s] if b != -np.inf else HIDDEN
            kbias[at + s] = b if b != -np.inf else 0


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _softmax_row(row, n, kpos, kbias, position, window):  # pragma: no cover (numba)
    """A row of n scores into its weights, in place: the keys it does not see (kpos above position, or with a window
    at or below position - window) -inf, the others plus their bias, then batch_decode_kernel's softmax (`_normalise`:
    exp(score - max) / sum in 16-lane vectors); a row that sees no key into zeros."""
    low = position - window if window > 0 else MIN_POSITION
    for t in range(n):
        key = kpos[t]
        row[t] = row[t] + kbias[t] if key <= position and key > low else -np.inf
    _normalise(row, n)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _values(scores, v_rows, top, nq, at, acc):  # pragma: no cover (numba)
    """acc[i] += sum over a page's slots s below top of scores[i, at + s] v_rows[s] for rows i < nq (v_rows: its
    float32 rows, `_page_rows`): each row's sums in registers (kernel_intrinsics.weigh_rows) where d is a multiple of
    16, else batch_decode_kernel's `_page_values`."""
    d = acc.shape[1]
    if d % LANES:
        _page_values(scores, v_rows, top, 0, nq, at, acc)
        return
    for i in range(nq):
        weigh_rows(acc.ctypes.data + i * d * 4, scores.ctypes.data + (i * scores.shape[1] + at) * 4, v_rows.ctypes.data,
                   top, d)


# (not inlined: one compiled function that _items and _last_rows call; inlined into both, a first compile of the
# module took 18 s against 10.5)
@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def _block(q, scale, k, v, table, used, bias, key_positions, positions, r0, r1, window, out, weights,
           buffers):  # pragma: no cover (numba)
    """Rows r0 .. r1 of one sequence (its table's first `used` pages) into out (r1 - r0, n_heads, d); with weights
    (n_heads, widest * page_size; else (0, 0)), the last row's weights there. buffers: (query, scores, kt, acc,
    v_page, tops, kpos, kbias), `_buffers`'."""
    query, scores, kt, acc, v_page, tops, kpos, kbias = buffers
    n_heads, d = q.shape[1], q.shape[2]
    n_kv, ps = k.shape[0], k.shape[2]
    group, m = n_heads // n_kv, r1 - r0
    n, nq = used * ps, (r1 - r0) * (n_heads // n_kv)
    for p in range(used):  # each page's slots above its last resident one are empty: never read
        base, top = table[p] * ps, ps
        while top > 0 and bias[base + top - 1] == -np.inf:
            top -= 1
        tops[p] = top
    _gather_keys(table, used, tops, ps, bias, key_positions, kpos, kbias)
    for h in range(n_kv):
        for r in range(m):
            for g in range(group):
                for j in range(d):
                    query[r * group + g, j] = q[r0 + r, h * group + g, j] * scale
        _transposed(k, h, table, used, tops, kt)
        _scores(query, nq, kt, n, scores)
        for r in range(m):
            for g in range(group):
                _softmax_row(scores[r * group + g], n, kpos, kbias, positions[r0 + r], window)
        acc[:nq] = 0
        for p in range(used):
            _values(scores, _page_rows(v, h, table[p], tops[p], v_page), tops[p], nq, p * ps, acc)
        for r in range(m):
            for g in range(group):
                for j in range(d):
                    out[r, h * group + g, j] = acc[r * group + g, j]
        if weights.shape[0]:
            for g in range(group):
                weights[h * group + g, :n] = scores[(m - 1) * group + g, :n]
                weights[h * group + g, n:] = 0


@njit(cache=True, nogil=True, inline="always")
def _buffers(n_heads, d, n_kv, ps, widest):  # pragma: no cover (numba)
    """`_block`'s scratch for up to ROWS rows: the scaled queries and the scores of one KV head's group, the keys
    transposed, the outputs' sums, a widened value page, each page's top, the slots' positions and biases
    (`_gather_keys`)."""
    rows = ROWS * (n_heads // n_kv)
    return (np.empty((rows, d), np.float32), np.empty((rows, widest * ps), np.float32),
            np.empty((d, widest * ps), np.float32), np.empty((rows, d), np.float32), np.empty((ps, d), np.float32),
            np.empty(widest, np.int64), np.empty(widest * ps, np.int64), np.empty(widest * ps, np.float32))


@njit(_SIGNATURE, cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def _items(q, scale, k, v, tables, n_pages, bias, key_positions, positions, starts, window, result, i0,
           i1):  # pragma: no cover
    """Items i0 .. i1 (rows i * ROWS .. (i + 1) * ROWS) into their rows of result (one an item, a whole number of
    TILE floats: its rows' outputs (n_heads, d) one after another), each sequence's part of an item a `_block`."""
    n_rows, n_heads, d = q.shape
    buffers = _buffers(n_heads, d, k.shape[0], k.shape[2], tables.shape[1])
    no_weights = np.empty((0, 0), np.float32)
    b = 0
    for i in range(i0, i1):
        lo, hi = i * ROWS, min(n_rows, (i + 1) * ROWS)
        while starts[b + 1] <= lo:
            b += 1
        out = result[i][:ROWS * n_heads * d].reshape((ROWS, n_heads, d))
        r = lo
        while r < hi:
            while starts[b + 1] <= r:
                b += 1
            end = min(hi, starts[b + 1])
            _block(q, scale, k, v, tables[b], n_pages[b], bias, key_positions, positions, r, end, window,
                   out[r - lo:end - lo], no_weights, buffers)
            r = end


@njit(_LAST_SIGNATURE, cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def _last_rows(q, scale, k, v, tables, n_pages, bias, key_positions, positions, starts, window, wanted,
               weights):  # pragma: no cover
    """weights[w] = the weights of the last row of sequence wanted[w] (its output computed again, not kept)."""
    n_heads, d = q.shape[1], q.shape[2]
    buffers = _buffers(n_heads, d, k.shape[0], k.shape[2], tables.shape[1])
    out = np.empty((1, n_heads, d), np.float32)
    for w in range(wanted.size):
        b = wanted[w]
        end = starts[b + 1]
        _block(q, scale, k, v, tables[b], n_pages[b], bias, key_positions, positions, end - 1, end, window, out,
               weights[w], buffers)


_i64, _f32, _u16 = pointer_to(types.int64), pointer_to(types.float32), pointer_to(types.uint16)
_POOL_SIGNATURE = types.void(*(types.int64,) * 7)


@njit(cache=True, nogil=True, inline="always")
def _pool_items(items, h, k, v, t0, t1, target):  # pragma: no cover (numba)
    """pool_kernel's work: `items` (_items, or its float16 twin) over the handle h's arrays, k and v read from it by
    the caller (float32, or float16's bits)."""
    n_rows, n_heads, d, tiles, batch = h[N_ROWS], h[HEADS], h[DIM], h[ITEM_TILES], h[BATCH]
    scale = carray(_f32(h.ctypes.data + 8 * SCALE), (1,))[0]  # (its float32's bits)
    items(carray(_f32(h[Q]), (n_rows, n_heads, d)), scale, k, v, carray(_i64(h[TABLES]), (batch, h[WIDEST])),
          carray(_i64(h[N_PAGES]), (batch,)), carray(_f32(h[BIAS]), (h[SLOTS],)),
          carray(_i64(h[KEY_POSITIONS]), (h[N_KEY_POSITIONS],)), carray(_i64(h[POSITIONS]), (n_rows,)),
          carray(_i64(h[STARTS]), (batch + 1,)), h[WINDOW], carray(_f32(target), (-(-n_rows // ROWS), tiles * TILE)),
          t0 // tiles, t1 // tiles)


@cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
def pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
    """Tiles t0..t1 of the result at target, whole items (`_items`) of the handle at address at: spin_pool's
    rows-kernel signature (job, n and stride unused), so the pool's two threads share a layer's items."""
    h = carray(_i64(at), (HANDLE,))
    shape = (h[N_KV], h[PAGES], h[PAGE_SIZE], h[DIM])
    _pool_items(_items, h, carray(_f32(h[K]), shape), carray(_f32(h[V]), shape), t0, t1, target)


_FILL_SIGNATURE = ("void(int64[::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], "
                   "int64[::1], float32[::1], int64[::1], int64[::1], int64[::1], int64, int64)")


@njit(_FILL_SIGNATURE, cache=True, nogil=True, boundscheck=False)
def _fill(handle, q, k, v, tables, n_pages, bias, key_positions, positions, starts, window, tiles):  # pragma: no cover
    """The handle's shapes and addresses (its SCALE word: attend_chunks writes the float32's bits)."""
    handle[N_ROWS], handle[HEADS], handle[DIM] = q.shape
    handle[N_KV], handle[PAGES], handle[PAGE_SIZE] = k.shape[0], k.shape[1], k.shape[2]
    handle[BATCH], handle[WIDEST], handle[SLOTS], handle[WINDOW] = tables.shape[0], tables.shape[1], bias.size, window
    handle[ITEM_TILES], handle[N_KEY_POSITIONS] = tiles, key_positions.size
    handle[Q], handle[K], handle[V], handle[TABLES] = q.ctypes.data, k.ctypes.data, v.ctypes.data, tables.ctypes.data
    handle[N_PAGES], handle[BIAS] = n_pages.ctypes.data, bias.ctypes.data
    handle[KEY_POSITIONS], handle[POSITIONS], handle[STARTS] = (key_positions.ctypes.data, positions.ctypes.data,
                                                                starts.ctypes.data)


class Kernels(NamedTuple):
    """This module's kernels for one element type of the pages: FLOAT32's, or float16's read through their bits
    (uint16 views: half_kernels)."""
    items: Any
    last_rows: Any
    fill: Any
    pool_kernel: int


FLOAT32 = Kernels(_items, _last_rows, _fill, int(pool_kernel.address or 0))
_HALF_ITEMS: Any = None  # _items of float16 pages, once built (a global, not a closure's: batch_decode_kernel's why)


def half_kernels() -> Kernels:
    """The kernels of float16 pages, compiled or loaded from numba's cache the first time a float16 store needs them
    (through kernel_loader.import_kernels: under the compile lock), not when this module is imported."""
    return import_kernels(__name__, "the chunked attention kernels (float16 pages)", part="float16",
                          build=lambda module: module.build_half_kernels())


def build_half_kernels() -> Kernels:
    """half_kernels' compile: the same Python functions with uint16 K/V (numba's cache keeps them beside float32's)."""
    four = "float32[:, :, :, ::1], float32[:, :, :, ::1]"
    half = four.replace("float32", "uint16")
    global _HALF_ITEMS
    _HALF_ITEMS = njit(_SIGNATURE.replace(four, half, 1), cache=True, nogil=True, fastmath=_FAST, error_model="numpy",
                       boundscheck=False)(_items.py_func)

    @cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
    def half_pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
        h = carray(_i64(at), (HANDLE,))
        shape = (h[N_KV], h[PAGES], h[PAGE_SIZE], h[DIM])
        _pool_items(_HALF_ITEMS, h, carray(_u16(h[K]), shape), carray(_u16(h[V]), shape), t0, t1, target)

    return Kernels(_HALF_ITEMS, njit(_LAST_SIGNATURE.replace(four, half, 1), cache=True, nogil=True, fastmath=_FAST,
                                     error_model="numpy", boundscheck=False)(_last_rows.py_func),
                   njit(_FILL_SIGNATURE.replace(four, half, 1), cache=True, nogil=True, boundscheck=False)(
                       _fill.py_func), int(half_pool_kernel.address or 0))


def kernels_for(k: np.ndarray) -> Kernels:
    """The kernels of pages of k's element type: float32 (FLOAT32) or float16 (half_kernels)."""
    return FLOAT32 if k.dtype == np.float32 else half_kernels()


def attend_chunks(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, n_pages: np.ndarray,
                  bias: np.ndarray, key_positions: np.ndarray, positions: np.ndarray, starts: np.ndarray,
                  window: int = 0, pool: Any = None, wanted: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """See the module docstring; q is scaled by 1 / sqrt(d) here, as attention_kernels.attend scales it. k, v: float32
    or float16 pages (read through their bits). pool: the weights' spin pool (model/spin_pool.py, handed in by the
    engine: the cache imports no model) or None; with it the items are shared with its helper thread, each computed
    whole: the same bits. wanted: the sequences (indices) whose last row's weights are returned (None: all)."""
    n_rows, n_heads, d = q.shape
    batch = len(starts) - 1
    width = tables.shape[1] * k.shape[2]
    tiles = -(-ROWS * n_heads * d // TILE)
    n_items = -(-n_rows // ROWS)
    result = np.empty((n_items, tiles * TILE), np.float32)
    kernels = kernels_for(k)
    arrays = (np.ascontiguousarray(q, dtype=np.float32), bits(k), bits(v), np.ascontiguousarray(tables, dtype=np.int64),
              np.ascontiguousarray(n_pages, dtype=np.int64), np.ascontiguousarray(bias, dtype=np.float32),
              np.ascontiguousarray(key_positions, dtype=np.int64), np.ascontiguousarray(positions, dtype=np.int64),
              np.ascontiguousarray(starts, dtype=np.int64))
    scale = np.float32(1.0 / np.sqrt(d))
    if pool is None or n_items < 2:
        kernels.items(arrays[0], scale, *arrays[1:], window, result, 0, n_items)
    else:
        pool.items(kernels.pool_kernel, _job(n_items * tiles), _handle(arrays, scale, window, tiles, kernels),
                   arrays, result.reshape(-1), n_items)
    rows = result[:, :ROWS * n_heads * d] if tiles * TILE > ROWS * n_heads * d else result
    output = rows.reshape(n_items * ROWS, n_heads, d)[:n_rows]
    chosen = np.arange(batch, dtype=np.int64) if wanted is None else np.asarray(wanted, dtype=np.int64)
    weights = np.empty((len(chosen), n_heads, width), np.float32)
    if len(chosen):
        kernels.last_rows(arrays[0], scale, *arrays[1:], window, chosen, weights)
    return output, weights


def _handle(arrays: tuple, scale: np.float32, window: int, tiles: int, kernels: Kernels = FLOAT32) -> np.ndarray:
    """pool_kernel's handle of attend_chunks' arrays (q, k, v, tables, n_pages, bias, key_positions, positions,
    starts): their shapes and addresses and the queries' scale (kernels: those of k's element type)."""
    handle = np.zeros(HANDLE, np.int64)
    kernels.fill(handle, *arrays, window, tiles)
    handle[SCALE:SCALE + 1].view(np.float32)[0] = scale
    return handle

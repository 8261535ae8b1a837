"""Decode attention of several sequences in one numba call per layer, each over its own pages, read where they lie.

`attend_tables(q, k, v, tables, n_pages, bias, key_positions, positions, window)`: one decode query for each of B
sequences (q: (B, n_heads, d)), the pool's K and V as the page store holds them ((n_kv, pages, page_size, d)
float32 or float16), each sequence's block table (tables: (B, widest) page ids, row b's first n_pages[b] used), the
pool's occupancy bias per flat slot (page * page_size + slot: 0 resident, -inf empty) and, with window > 0, each slot's
position and each query's: a key at or below position - window is hidden (a sliding window's layer). Returns the
output (B, n_heads, d) and the weights (B, n_heads, widest * page_size), normalised, exactly 0 on hidden slots and
padding; a sequence with no visible key gets zeros. What `attention_kernels.attend_decode_batch` computes over
gathered keys, without the gather (a copy of every sequence's pages a layer), the bias's gather or NumPy's calls on
small arrays.
Per sequence and KV head, a page at a time (its keys are contiguous). Pages of a multiple of LANES (16) slots and
heads of a multiple of 16 floats (every model here: pages of 16, heads of 64 or 256) take the lanes path, in 16-lane
vectors spelt in LLVM's IR (kernel_intrinsics): each query head's scores 16 keys at a time, whose sums are added side
by side (dots16: two shuffles and a sum a pair of vectors, where one horizontal sum a dot product took four shuffles
and four sums), its softmax 16 columns at a time (`_normalise`: LLVM vectorised neither its running max nor the
exponentials past its unrolled body), its values summed in registers over a page's rows, each row read once for a group of 3 or 4 query heads
(weigh_heads3, 4; other groups a head at a time: weigh_rows). Other shapes
take the first kernel's loops: four keys at a time, each of the group's query heads taking the four dot products
sharing its loads (scores), or adding the four value rows, read again from the first level of cache, each times its
weight (values), then decode_kernel's `_softmax`. A page's slots above its last resident one (a sequence's newest page
is commonly part full) weigh exactly 0, as the bias makes them: their values are never read (the lanes path reads the
keys of a whole block of 16, then sets those scores to -inf; the loops read both up to the next multiple of four).
The K/V come from memory (a step's weights pushed them out of every cache; one core reads them at about 25 GB/s here,
measured) and a sequence's pages lie anywhere, where the hardware's prefetcher follows no stream: the lanes path asks
for the page it reads next (K's next, then V's first; V's next, then the next head's or sequence's first K page) a
part before each query head's work on the page before it (measured, 8 sequences x 224 keys, K/V 2.75 MB: the loops
180 us a call, the lanes path with each page's V asked for during its scores 154, as here 123; the reads alone take
80-120). Query head h reads KV head h // group; sums in any order (fastmath reassoc), so results agree with the
one-sequence kernel and with float64 within float32 rounding.
Each sequence is computed whole by one call of `_sequences`, so the same inputs give the same bits however the
sequences are split among calls (threads). With two weight threads the engine hands in the weights' spin pool
(paged_attention.share_pool; the cache imports no model) and a layer's sequences are shared with its helper thread,
one a chunk (model/spin_pool.py's `items`, calling `pool_kernel` through its address): the helper writes only into
the pool's scratch, which the caller copies from once a sequence is marked done; one the helper is late on the caller
computes itself, and the helper's late copy lands in the scratch (held by the pool with every array the handle
points into while the helper may read them), never in the result.
Float16 pages are read and written through their uint16 views, as decode_kernel.py's (`Kernels`: FLOAT32, and
half_kernels, compiled the first time a float16 store needs them).
Compiled once and kept in numba's on-disk cache, as decode_kernel.py is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import carray, cfunc, njit, types
from numba.extending import overload

from pagevis.kernel_intrinsics import (dots16, lanes_exps, lanes_peak, narrow, pointer_to, prefetch, weigh_heads3, weigh_heads4,
                                       weigh_rows, widen)
from pagevis.kernel_loader import import_kernels
from pagevis.kvcache.decode_kernel import EXP_FLOOR, _exp, _softmax, bits

_FAST = {"reassoc", "contract"}
NO_POSITIONS = np.zeros(0, np.int64)
_SIGNATURE = ("void(float32[:, :, ::1], float32, float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], int64[::1], "
              "float32[::1], int64[::1], int64[::1], int64, float32[:, ::1], int64, int64, int64[::1], float32[:, :, ::1], "
              "float32[:, :, ::1], int64[::1])")
NO_WRITES = np.zeros(0, np.int64)  # `_sequences`' flats when it writes no token
NO_ROWS = np.zeros((0, 1, 1), np.float32)
# model/spin_pool.py's, which the cache cannot import (tests/test_batch_decode_kernel.py checks they agree): a
# sequence's row of the result is a whole number of TILE floats, one item of the pool's job, whose word TILES_WORD
# counts the job's tiles (its descriptor: DESCRIPTOR words)
TILE, DESCRIPTOR, TILES_WORD = 64, 36, 4
# pool_kernel's handle: the shapes, then the arrays' addresses
BATCH, HEADS, DIM, N_KV, PAGES, PAGE_SIZE, WIDEST, SLOTS, WINDOW, ROW_TILES, N_KEY_POSITIONS, SCALE = range(12)
Q, K, V, TABLES, N_PAGES, BIAS, KEY_POSITIONS, POSITIONS = range(12, 20)
HANDLE = 20


@njit(cache=True, nogil=True, inline="always")
def _page_at(array, h, page):  # pragma: no cover (numba)
    """The address of KV head h's rows in a page of array (n_kv, pages, page_size, d)."""
    return array.ctypes.data + (h * array.shape[1] + page) * array.shape[2] * array.shape[3] * array.itemsize


def _page_rows(array, h, page, top, scratch):
    """KV head h's rows of a page of array (n_kv, pages, page_size, d) as float32 (page_size, d), those read (below top
    rounded up to four): array[h, page] itself (float32 pages), or widened into scratch once (float16's bits: each row
    is read by every query row of the group); compiled code only."""
    raise NotImplementedError


@overload(_page_rows, inline="always")
def _page_rows_float32(array, h, page, top, scratch):
    if array.dtype == types.float32:
        return lambda array, h, page, top, scratch: array[h, page]

    def widened(array, h, page, top, scratch):  # pragma: no cover (numba)
        for s in range(min(array.shape[2], (top + 3) // 4 * 4)):
            for j in range(array.shape[3]):
                scratch[s, j] = widen(array[h, page, s, j])
        return scratch
    return widened


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _page_scores(q, k, top, first, rows, at, weights, ahead, also, row_bytes):  # pragma: no cover (numba)
    """weights[g, at + s] = q[g] . k[s] for the chunk's rows g and a page's slots below top (k: its (page_size, d)
    float32 rows, `_page_rows`; rounded up to four; -inf above: empty slots, never read), four slots at a time (each
    row's four dot products sharing its loads); asking for the page at address ahead (the next K page read) and the one
    at also (this page's values), four rows of each (row_bytes each, as stored) an iteration."""
    ps, d = k.shape
    body = min(ps // 4 * 4, (top + 3) // 4 * 4)
    for s in range(0, body, 4):
        r0, r1, r2, r3 = k[s], k[s + 1], k[s + 2], k[s + 3]
        for line in range(s * row_bytes, (s + 4) * row_bytes, 64):
            prefetch(ahead + line)
            prefetch(also + line)
        for g in range(first, first + rows):
            row = q[g]
            x0 = x1 = x2 = x3 = np.float32(0)
            for j in range(d):
                x0 += row[j] * r0[j]
                x1 += row[j] * r1[j]
                x2 += row[j] * r2[j]
                x3 += row[j] * r3[j]
            weights[g, at + s], weights[g, at + s + 1], weights[g, at + s + 2], weights[g, at + s + 3] = x0, x1, x2, x3
    for s in range(body, top):
        for g in range(first, first + rows):
            total = np.float32(0)
            for j in range(d):
                total += q[g, j] * k[s, j]
            weights[g, at + s] = total
    for s in range(max(body, top), ps):
        for g in range(first, first + rows):
            weights[g, at + s] = -np.inf


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _page_values(weights, v, top, first, rows, at, acc):  # pragma: no cover (numba)
    """acc[i] += sum over a page's slots s below top (v: its (page_size, d) float32 rows, `_page_rows`; rounded up to
    four: those above weigh 0, never read) of weights[first + i, at + s] v[s], four slots at a time (each output row
    reading the four value rows again, from the first level of cache)."""
    ps, d = v.shape
    body = min(ps // 4 * 4, (top + 3) // 4 * 4)
    for s in range(0, body, 4):
        r0, r1, r2, r3 = v[s], v[s + 1], v[s + 2], v[s + 3]
        for i in range(rows):
            w, out = weights[first + i], acc[i]
            a, b, c, e = w[at + s], w[at + s + 1], w[at + s + 2], w[at + s + 3]
            for j in range(d):
                out[j] += a * r0[j] + b * r1[j] + c * r2[j] + e * r3[j]
    for s in range(body, top):
        for i in range(rows):
            w = weights[first + i, at + s]
            for j in range(d):
                acc[i, j] += w * v[s, j]


LANES = 16  # pages of a multiple of LANES slots and heads of a multiple of LANES floats take `_page_dots`, `_page_weigh`


@njit(cache=True, nogil=True, inline="always")
def _ask_part(ahead, page_bytes, i, parts):  # pragma: no cover (numba)
    """Asks for part i of parts of the page at address ahead (page_bytes): a page's lines spread over the work before
    it, not all at once (the first level's few miss buffers would stall that work)."""
    for line in range(page_bytes * i // parts // 64 * 64, page_bytes * (i + 1) // parts // 64 * 64, 64):
        prefetch(ahead + line)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _page_dots(query, rows_at, top, first, rows, at, weights, ahead, page_bytes, ps):  # pragma: no cover (numba)
    """`_page_scores` of a page of a multiple of LANES slots and rows of a multiple of LANES floats (k: its float32
    rows at address rows_at, `_page_rows`): each query row's scores LANES slots at a time (kernel_intrinsics.dots16:
    their sums side by side, not one horizontal sum a dot product), the blocks below top (the slots above it in a
    block read too: a page's own memory; their scores then -inf). Asks for the page at ahead (page_bytes), a part
    before each row's."""
    d = query.shape[1]
    base, stride = weights.ctypes.data + at * 4, weights.shape[1] * 4
    for g in range(first, first + rows):
        _ask_part(ahead, page_bytes, g - first, rows)
        for s in range(0, top, LANES):
            dots16(base + g * stride + s * 4, query.ctypes.data + g * d * 4, rows_at + s * d * 4, d)
        for s in range(top, ps):
            weights[g, at + s] = -np.inf


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _page_weigh(weights, rows_at, top, first, rows, at, acc, ahead, page_bytes):  # pragma: no cover (numba)
    """`_page_values` of rows of a multiple of LANES floats (v: its float32 rows at address rows_at, `_page_rows`):
    each output row's sum over the slots below top in registers, only those read: a group of 3 or 4 query heads (SmolLM2's,
    Gemma 3's) at once (kernel_intrinsics.weigh_heads3, 4: each value row read once for the group), other groups a head
    at a time (weigh_rows: each more compiled variant costs ~1 s of a first launch). Asks for the page at ahead
    (page_bytes), half before each half of the slots (a group of 3 or 4), a part before each head's (others)."""
    d, width = acc.shape[1], weights.shape[1]
    w_at = weights.ctypes.data + (first * width + at) * 4
    if rows == 3 or rows == 4:
        half = min(top, LANES // 2)
        for lo, hi, part in ((0, half, 0), (half, top, 1)):
            _ask_part(ahead, page_bytes, part, 2)
            if rows == 3:
                weigh_heads3(acc.ctypes.data, w_at + lo * 4, width, rows_at + lo * d * 4, hi - lo, d)
            else:
                weigh_heads4(acc.ctypes.data, w_at + lo * 4, width, rows_at + lo * d * 4, hi - lo, d)
        return
    for i in range(rows):
        _ask_part(ahead, page_bytes, i, rows)
        weigh_rows(acc.ctypes.data + i * d * 4, w_at + i * width * 4, rows_at, top, d)


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _normalise(row, n):  # pragma: no cover (numba)
    """decode_kernel's `_softmax` of row[:n] in place (a row with no visible key into zeros), LANES columns at a time
    (kernel_intrinsics.lanes_peak, lanes_exps: LLVM lays out neither the running max nor, past its unrolled
    body, the exponentials as vectors), the columns past the last whole LANES one at a time."""
    body = n // LANES * LANES
    peak = lanes_peak(row.ctypes.data, n // LANES)
    for t in range(body, n):
        peak = max(peak, row[t])
    if peak == -np.inf:
        for t in range(n):
            row[t] = 0
        return
    total = lanes_exps(row.ctypes.data, n // LANES, peak, EXP_FLOOR)
    for t in range(body, n):
        e = _exp(row[t] - peak)
        row[t] = e
        total += e
    inverse = np.float32(1) / total
    for t in range(n):
        row[t] *= inverse


@njit(cache=True, nogil=True, inline="always", fastmath=_FAST, error_model="numpy", boundscheck=False)
def _mask(row, table, n_pages, ps, bias, key_positions, position, window):  # pragma: no cover (numba)
    """The occupancy bias of the table's slots added to a row of scores, and with a window its hidden keys' -inf."""
    for p in range(n_pages):
        base, at = table[p] * ps, p * ps
        for s in range(ps):
            row[at + s] += bias[base + s]
        if window > 0:
            for s in range(ps):
                if key_positions[base + s] <= position - window:
                    row[at + s] = -np.inf


@njit(cache=True, nogil=True, inline="always", boundscheck=False)
def _write_token(k, v, key_positions, fill, bias, flat, new_k, new_v, row, position):  # pragma: no cover (numba)
    """Row `row` of new_k, new_v (B, n_kv, d) into flat slot `flat` of k, v (n_kv, pages, page_size, d): its K/V, its
    position, its page's fill and its occupancy bias (0): what PageStore.write_rows does for one token."""
    ps = k.shape[2]
    page, slot = flat // ps, flat % ps
    for h in range(k.shape[0]):
        for e in range(k.shape[3]):
            k[h, page, slot, e] = narrow(new_k[row, h, e], k)
            v[h, page, slot, e] = narrow(new_v[row, h, e], v)
    key_positions[flat] = position
    fill[page] += 1
    bias[flat] = 0


@njit(_SIGNATURE, cache=True, nogil=True, fastmath=_FAST, error_model="numpy", boundscheck=False)
def _sequences(q, scale, k, v, tables, n_pages, bias, key_positions, positions, window, result, b0, b1, flats, new_k,
               new_v, fill):  # pragma: no cover
    """Sequences b0 .. b1 into their rows of result (B, a whole number of TILE floats): the output (n_heads, d),
    then the weights (n_heads, widest * page_size); each sequence whole, the same bits whichever call computes it.
    Each query scaled by scale first (one float32 product an element, as NumPy's). With flats (B,) (else empty),
    sequence b's token (row b of new_k, new_v, at positions[b]) is written into slot flats[b] first (one thread only:
    `attend_tables`), the lines its attention reads next."""
    n_heads, d = q.shape[1], q.shape[2]
    n_kv, ps = k.shape[0], k.shape[2]
    group = n_heads // n_kv
    width = tables.shape[1] * ps
    acc = np.empty((group, d), np.float32)
    query = np.empty((n_heads, d), np.float32)
    tops = np.empty(tables.shape[1], np.int64)
    k_page, v_page = np.empty((ps, d), np.float32), np.empty((ps, d), np.float32)  # (float16 pages' rows, widened)
    row_bytes = d * k.itemsize
    page_bytes = ps * row_bytes
    lanes_fit = ps % LANES == 0 and d % LANES == 0
    for b in range(b0, b1):
        if flats.size:
            _write_token(k, v, key_positions, fill, bias, flats[b], new_k, new_v, b, positions[b])
        for g in range(n_heads):
            for j in range(d):
                query[g, j] = q[b, g, j] * scale
        out = result[b][:n_heads * d].reshape((n_heads, d))
        weights = result[b][n_heads * d:n_heads * (d + width)].reshape((n_heads, width))
        table, used = tables[b], n_pages[b]
        n = used * ps
        position = positions[b] if window > 0 else 0
        for p in range(used):  # each page's slots above its last resident one are empty: never read
            base, top = table[p] * ps, ps
            while top > 0 and bias[base + top - 1] == -np.inf:
                top -= 1
            tops[p] = top
        for h in range(n_kv):
            # the K page read after this head's last: the next head's first, or the next sequence's
            after = (_page_at(k, h + 1, table[0] if used else 0) if h + 1 < n_kv else
                     _page_at(k, 0, tables[b + 1, 0] if b + 1 < len(tables) and n_pages[b + 1] else 0))
            first = h * group
            for p in range(used):
                rows = _page_rows(k, h, table[p], tops[p], k_page)
                if lanes_fit:
                    _page_dots(query, rows.ctypes.data, tops[p], first, group, p * ps, weights,
                               _page_at(k, h, table[p + 1]) if p + 1 < used else _page_at(v, h, table[0]), page_bytes, ps)
                else:
                    ahead = _page_at(k, h, table[p + 1]) if p + 1 < used else after
                    _page_scores(query, rows, tops[p], first, group, p * ps, weights, ahead, _page_at(v, h, table[p]),
                                 row_bytes)
            for g in range(first, first + group):
                _mask(weights[g], table, used, ps, bias, key_positions, position, window)
                if lanes_fit:
                    _normalise(weights[g], n)
                else:
                    _softmax(weights, g, n)
            acc[:] = 0
            for p in range(used):
                rows = _page_rows(v, h, table[p], tops[p], v_page)
                if lanes_fit:
                    _page_weigh(weights, rows.ctypes.data, tops[p], first, group, p * ps, acc,
                                _page_at(v, h, table[p + 1]) if p + 1 < used else after, page_bytes)
                else:
                    _page_values(weights, rows, tops[p], first, group, p * ps, acc)
            for i in range(group):
                for j in range(d):
                    out[first + i, j] = acc[i, j]
                weights[first + i, n:] = 0


_WRITE_ROWS_SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, ::1], int64[::1], int64[::1], float32[::1], int64[::1], "
                         "int64[::1], float32[:, :, ::1], float32[:, :, ::1], int64[::1], int64)")


@njit(_WRITE_ROWS_SIGNATURE, cache=True, nogil=True, boundscheck=False)
def _write_rows(k_rows, v_rows, positions, fill, bias, flats, rows, k, v, token_positions, page_size):  # pragma: no cover
    """Row rows[i] of k, v (B, n_kv, d) and of token_positions into flat slot flats[i] of the pool's rows (n_kv,
    slots, d): its K/V (rounded to the pool's element: narrow), position, page fill and occupancy bias (0)."""
    for i in range(flats.size):
        flat, row = flats[i], rows[i]
        for h in range(k_rows.shape[0]):
            for e in range(k_rows.shape[2]):
                k_rows[h, flat, e] = narrow(k[row, h, e], k_rows)
                v_rows[h, flat, e] = narrow(v[row, h, e], v_rows)
        positions[flat] = token_positions[row]
        fill[flat // page_size] += 1
        bias[flat] = 0


def write_rows(k_rows: np.ndarray, v_rows: np.ndarray, positions: np.ndarray, fill: np.ndarray, bias: np.ndarray,
               flats: np.ndarray, rows: np.ndarray, k: np.ndarray, v: np.ndarray, token_positions: np.ndarray,
               page_size: int) -> None:
    """A page store's `write` of several tokens in one call (PageStore.write_rows): see _write_rows. k_rows, v_rows:
    float32 or float16 (rounded as NumPy's astype rounds)."""
    kernels_for(k_rows).write_rows(bits(k_rows), bits(v_rows), positions, fill, bias, flats, rows,
                                   np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32),
                                   np.ascontiguousarray(token_positions, dtype=np.int64), page_size)


_i64, _f32, _u16 = pointer_to(types.int64), pointer_to(types.float32), pointer_to(types.uint16)
_POOL_SIGNATURE = types.void(*(types.int64,) * 7)


@njit(cache=True, nogil=True, inline="always")
def _pool_sequences(sequences, h, k, v, t0, t1, target):  # pragma: no cover (numba)
    """pool_kernel's work: `sequences` (_sequences, or its float16 twin) over the handle h's arrays, k and v read from
    it by the caller (float32, or float16's bits). Writes nothing: empty write arrays, at address 0 (none allocated)."""
    batch, n_heads, d, tiles = h[BATCH], h[HEADS], h[DIM], h[ROW_TILES]
    scale = carray(_f32(h.ctypes.data + 8 * SCALE), (1,))[0]  # (its float32's bits)
    none, no_rows = carray(_i64(0), (0,)), carray(_f32(0), (0, 1, 1))
    sequences(carray(_f32(h[Q]), (batch, n_heads, d)), scale, k, v, carray(_i64(h[TABLES]), (batch, h[WIDEST])),
              carray(_i64(h[N_PAGES]), (batch,)), carray(_f32(h[BIAS]), (h[SLOTS],)),
              carray(_i64(h[KEY_POSITIONS]), (h[N_KEY_POSITIONS],)), carray(_i64(h[POSITIONS]), (batch,)), h[WINDOW],
              carray(_f32(target), (batch, tiles * TILE)), t0 // tiles, t1 // tiles, none, no_rows, no_rows,
              none)  # (the caller wrote the tokens: `_fill`)


@cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
def pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
    """Tiles t0..t1 of the result at target, whole sequences (`_sequences`) of the handle at address at: spin_pool's
    rows-kernel signature (job, n and stride unused), so the pool's two threads share a layer's sequences."""
    h = carray(_i64(at), (HANDLE,))
    shape = (h[N_KV], h[PAGES], h[PAGE_SIZE], h[DIM])
    _pool_sequences(_sequences, h, carray(_f32(h[K]), shape), carray(_f32(h[V]), shape), t0, t1, target)


_FILL_SIGNATURE = ("void(int64[::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], "
                   "int64[::1], float32[::1], int64[::1], int64[::1], int64, int64, int64[::1], float32[:, :, ::1], "
                   "float32[:, :, ::1], int64[::1])")


@njit(_FILL_SIGNATURE, cache=True, nogil=True, boundscheck=False)
def _fill(handle, q, k, v, tables, n_pages, bias, key_positions, positions, window, tiles, flats, new_k, new_v,
          fill):  # pragma: no cover
    """The handle's shapes and addresses (its SCALE word: attend_tables writes the float32's bits), after writing the
    decoding tokens (flats: none if empty; see attend_tables' `write`) before the helper may read their pages."""
    for b in range(flats.size):
        _write_token(k, v, key_positions, fill, bias, flats[b], new_k, new_v, b, positions[b])
    handle[BATCH], handle[HEADS], handle[DIM] = q.shape
    handle[N_KV], handle[PAGES], handle[PAGE_SIZE] = k.shape[0], k.shape[1], k.shape[2]
    handle[WIDEST], handle[SLOTS], handle[WINDOW], handle[ROW_TILES] = tables.shape[1], bias.size, window, tiles
    handle[N_KEY_POSITIONS] = key_positions.size
    handle[Q], handle[K], handle[V], handle[TABLES] = q.ctypes.data, k.ctypes.data, v.ctypes.data, tables.ctypes.data
    handle[N_PAGES], handle[BIAS] = n_pages.ctypes.data, bias.ctypes.data
    handle[KEY_POSITIONS], handle[POSITIONS] = key_positions.ctypes.data, positions.ctypes.data


class Kernels(NamedTuple):
    """This module's kernels for one element type of the pages: FLOAT32's, or float16's read and written through
    their bits (uint16 views: half_kernels)."""
    sequences: Any
    write_rows: Any
    fill: Any
    pool_kernel: int


FLOAT32 = Kernels(_sequences, _write_rows, _fill, int(pool_kernel.address or 0))


_HALF_SEQUENCES: Any = None  # _sequences of float16 pages, once built (a global, not a closure's: numba's cache keys a
# closure by its values, and a dispatcher's pickle differs in every process)


def half_kernels() -> Kernels:
    """The kernels of float16 pages, compiled or loaded from numba's cache the first time a float16 store needs them
    (through kernel_loader.import_kernels: under the compile lock), not when this module is imported."""
    return import_kernels(__name__, "the batched decode kernels (float16 pages)", part="float16",
                          build=lambda module: module.build_half_kernels())


def build_half_kernels() -> Kernels:
    """half_kernels' compile: the same Python functions with uint16 K/V (numba's cache keeps them beside float32's)."""
    def half(signature: str, kv: str) -> str:  # (the pages' K and V: the first arrays of that type)
        return signature.replace(kv, kv.replace("float32", "uint16"), 1)
    global _HALF_SEQUENCES
    four, three = "float32[:, :, :, ::1], float32[:, :, :, ::1]", "float32[:, :, ::1], float32[:, :, ::1], int64[::1]"
    _HALF_SEQUENCES = njit(half(_SIGNATURE, four), cache=True, nogil=True, fastmath=_FAST, error_model="numpy",
                           boundscheck=False)(_sequences.py_func)

    @cfunc(_POOL_SIGNATURE, cache=True, error_model="numpy")
    def half_pool_kernel(job, at, n, t0, t1, target, stride):  # pragma: no cover (numba)
        h = carray(_i64(at), (HANDLE,))
        shape = (h[N_KV], h[PAGES], h[PAGE_SIZE], h[DIM])
        _pool_sequences(_HALF_SEQUENCES, h, carray(_u16(h[K]), shape), carray(_u16(h[V]), shape), t0, t1, target)

    return Kernels(_HALF_SEQUENCES, njit(half(_WRITE_ROWS_SIGNATURE, three), cache=True, nogil=True,
                                   boundscheck=False)(_write_rows.py_func),
                   njit(half(_FILL_SIGNATURE, four), cache=True, nogil=True, boundscheck=False)(_fill.py_func),
                   int(half_pool_kernel.address or 0))


def kernels_for(k: np.ndarray) -> Kernels:
    """The kernels of pages of k's element type: float32 (FLOAT32) or float16 (half_kernels)."""
    return FLOAT32 if k.dtype == np.float32 else half_kernels()


_NO_WRITES = (NO_WRITES, NO_ROWS, NO_ROWS, NO_WRITES)


def attend_tables(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, n_pages: np.ndarray,
                  bias: np.ndarray, key_positions: np.ndarray = NO_POSITIONS, positions: np.ndarray | None = None,
                  window: int = 0, pool: Any = None, write: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """See the module docstring; q is scaled by 1 / sqrt(d) here, as attend_decode_batch scales it. k, v: float32 or
    float16 pages (read through their bits, the tokens of `write` rounded as NumPy's astype rounds). pool: the
    weights' spin pool (model/spin_pool.py, handed in by the engine: the cache imports no model) or None; with it, the
    sequences are shared with its helper thread, one a chunk (SpinPool.items), each computed whole: the same bits.
    write: (flats, new_k, new_v, fill), each sequence's decoding token written first as PageStore.write_rows writes
    them (row b of new_k, new_v (B, n_kv, d) into flat slot flats[b] (distinct slots, each in a page only sequence b
    reads) at positions[b]: key_positions, fill (per page) and bias are the store's): by `_sequences` itself on one
    thread, by the caller before the pool's job on two (the helper never writes: one it is late on may still run after
    this call returned, and its write then would land in a slot that may have changed since)."""
    batch, n_heads, d = q.shape
    width = tables.shape[1] * k.shape[2]
    tiles = -(-n_heads * (d + width) // TILE)
    result = np.empty((batch, tiles * TILE), np.float32)
    kernels = kernels_for(k)
    arrays = (np.ascontiguousarray(q, dtype=np.float32), bits(k), bits(v), np.ascontiguousarray(tables, dtype=np.int64),
              np.ascontiguousarray(n_pages, dtype=np.int64), np.ascontiguousarray(bias, dtype=np.float32),
              np.ascontiguousarray(key_positions, dtype=np.int64),
              np.zeros(batch, np.int64) if positions is None else np.ascontiguousarray(positions, dtype=np.int64))
    scale = np.float32(1.0 / np.sqrt(d))
    writes = _NO_WRITES if write is None else (
        np.ascontiguousarray(write[0], dtype=np.int64), np.ascontiguousarray(write[1], dtype=np.float32),
        np.ascontiguousarray(write[2], dtype=np.float32), write[3])
    if pool is None or batch < 2:
        kernels.sequences(arrays[0], scale, *arrays[1:], window, result, 0, batch, *writes)
    else:
        pool.items(kernels.pool_kernel, _job(batch * tiles), _handle(arrays, scale, window, tiles, writes, kernels),
                   arrays, result.reshape(-1), batch)
    return (np.ascontiguousarray(result[:, :n_heads * d]).reshape(batch, n_heads, d),
            result[:, n_heads * d:n_heads * (d + width)].reshape(batch, n_heads, width))


def _job(tiles: int) -> np.ndarray:
    job = np.zeros(DESCRIPTOR, np.int64)
    job[TILES_WORD] = tiles
    return job


def _handle(arrays: tuple, scale: np.float32, window: int, tiles: int, writes: tuple = _NO_WRITES,
            kernels: Kernels = FLOAT32) -> np.ndarray:
    """pool_kernel's handle of attend_tables' arrays (q, k, v, tables, n_pages, bias, key_positions, positions): their
    shapes and addresses (read in numba: NumPy's ctypes attribute costs ~2 us an array) and the queries' scale; the
    tokens of `writes` (flats, new_k, new_v, fill: attend_tables' `write`) written first (kernels: those of k's
    element type)."""
    handle = np.zeros(HANDLE, np.int64)
    kernels.fill(handle, *arrays, window, tiles, *writes)
    handle[SCALE:SCALE + 1].view(np.float32)[0] = scale
    return handle

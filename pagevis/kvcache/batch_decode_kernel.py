"""Decode attention of several sequences in one numba call per layer, each over its own pages, read where they lie.

`attend_tables(q, k, v, tables, n_pages, bias)`: one decode query for each of B sequences (q: (B, n_heads, d)), the
pool's K and V as the page store holds them ((n_kv, pages, page_size, d) float32), each sequence's block table
(tables: (B, widest) page ids, row b's first n_pages[b] used) and the additive bias of each table slot (B,
widest * page_size): 0 resident, -inf empty, padding or hidden by a window. Returns the output (B, n_heads, d) and
the weights (B, n_heads, widest * page_size), normalised, exactly 0 on masked slots and padding; a sequence with no
visible key gets zeros. What `attention_kernels.attend_decode_batch` computes over gathered keys, without the
gather (a copy of every sequence's pages a layer) and without NumPy's calls on small arrays: for SmolLM2's 8 and
16 sequences of ~40 tokens the batched attention took 7.3 and 11.4 ms of a step's CPU (docs/speed.md, batches).
Query head h reads KV head h // group; dot products and sums in any order (fastmath reassoc), the softmax the
single-sequence kernel's (decode_kernel._softmax: its exponential, normalised before the values), so results agree
with it and with float64 within float32 rounding.
Compiled once and kept in numba's on-disk cache, as decode_kernel.py is.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagevis.kvcache.decode_kernel import _softmax

_SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], int64[::1], "
              "float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1])")


@njit(_SIGNATURE, cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy", boundscheck=False)
def _attend(q, k, v, tables, n_pages, bias, out, weights):  # pragma: no cover (numba)
    """Per sequence and KV head, each key and value row read once for the group's query heads; each head's softmax
    decode_kernel's (`_softmax`: normalised before the values, as the one-sequence kernel does)."""
    batch, n_heads, d = q.shape
    ps = k.shape[2]
    group = n_heads // k.shape[0]
    acc = np.empty((group, d), np.float32)
    for b in range(batch):
        n = n_pages[b] * ps
        rows = weights[b]
        for kv in range(k.shape[0]):
            first = kv * group
            for j in range(n):
                score = bias[b, j]
                page, slot = tables[b, j // ps], j % ps
                for g in range(group):
                    value = score
                    if score > -np.inf:
                        dot = np.float32(0)
                        for e in range(d):
                            dot += q[b, first + g, e] * k[kv, page, slot, e]
                        value += dot
                    rows[first + g, j] = value
            for g in range(group):
                _softmax(rows, first + g, n)
            acc[:] = 0
            for j in range(n):
                page, slot = tables[b, j // ps], j % ps
                for g in range(group):
                    x = rows[first + g, j]
                    if x != 0:
                        for e in range(d):
                            acc[g, e] += x * v[kv, page, slot, e]
            for g in range(group):
                out[b, first + g] = acc[g]
                rows[first + g, n:] = 0


@njit("void(float32[:, :, ::1], float32[:, :, ::1], int64[::1], int64[::1], float32[::1], int64[::1], int64[::1], "
      "float32[:, :, ::1], float32[:, :, ::1], int64[::1], int64)", cache=True, nogil=True, boundscheck=False)
def _write_rows(k_rows, v_rows, positions, fill, bias, flats, rows, k, v, token_positions, page_size):  # pragma: no cover
    """Row rows[i] of k, v (B, n_kv, d) and of token_positions into flat slot flats[i] of the pool's rows (n_kv,
    slots, d): its K/V, position, page fill and occupancy bias (0)."""
    for i in range(flats.size):
        flat, row = flats[i], rows[i]
        for h in range(k_rows.shape[0]):
            for e in range(k_rows.shape[2]):
                k_rows[h, flat, e] = k[row, h, e]
                v_rows[h, flat, e] = v[row, h, e]
        positions[flat] = token_positions[row]
        fill[flat // page_size] += 1
        bias[flat] = 0


def write_rows(k_rows: np.ndarray, v_rows: np.ndarray, positions: np.ndarray, fill: np.ndarray, bias: np.ndarray,
               flats: np.ndarray, rows: np.ndarray, k: np.ndarray, v: np.ndarray, token_positions: np.ndarray,
               page_size: int) -> None:
    """A page store's `write` of several tokens in one call (PageStore.write_rows): see _write_rows."""
    _write_rows(k_rows, v_rows, positions, fill, bias, flats, rows, np.ascontiguousarray(k, dtype=np.float32),
                np.ascontiguousarray(v, dtype=np.float32), np.ascontiguousarray(token_positions, dtype=np.int64),
                page_size)


def attend_tables(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, n_pages: np.ndarray,
                  bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """See the module docstring; q is scaled by 1 / sqrt(d) here, as attend_decode_batch scales it."""
    batch, n_heads, d = q.shape
    out = np.empty((batch, n_heads, d), np.float32)
    weights = np.empty((batch, n_heads, bias.shape[1]), np.float32)
    _attend(np.multiply(q, np.float32(1.0 / np.sqrt(d)), dtype=np.float32), k, v,
            np.ascontiguousarray(tables, dtype=np.int64), np.ascontiguousarray(n_pages, dtype=np.int64),
            np.ascontiguousarray(bias, dtype=np.float32), out, weights)
    return out, weights

"""Attention kernels over key/value arrays laid out (n_kv_heads, n_keys, head_dim).

The paged cache calls `attend` on a view of its pool's allocated prefix, with an additive bias that is
0 for resident slots and -inf for empty ones; a dense caller passes contiguous arrays and a zero bias.
Grouped-query (and multi-query) attention: query head h reads KV head h // (n_heads // n_kv_heads).
Float16 storage is read in float32; all arithmetic is float32.

The kernel. The query heads of one KV head are one (rows, d) matrix (rows = queries x group), so each
key and value is read once per KV head, not once per query head. Two sweeps over the keys: the scores
(keys x queries), then, after the softmax, the output (weights x values). Softmax works in place on the
scores: max, subtract, exp, sum, and one division at the end that normalises the weights and the small
output together (the output is accumulated from the unnormalised weights). Float16 keys and values are
converted to float32 CHUNK_BYTES at a time into one reused buffer, never the whole cache at once. A few
rows against thousands of keys is a poor shape for BLAS's gemm (it packs the whole key matrix for three
rows: at 8,192 tokens the score product took 0.94 ms where reading the keys takes 0.22), so for up to
DECODE_ROWS rows the keys are cut into blocks (a free reshape) and np.matmul runs the small products in C;
the block sizes are measured once per shape (`block_sizes`).
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from pagevis.kernel_loader import import_kernels
from pagevis.query_blocks import query_block

CHUNK_BYTES = 1 << 20  # float16 keys (or values) of all KV heads converted to float32 at once: fits in L2
DECODE_ROWS = 32  # up to this many rows (queries x group) per KV head, key blocks are measured; above, gemm
BLOCK_CANDIDATES = (0, 32, 64, 128, 256)  # keys per block; 0: one product over the whole chunk
LOWEST = np.finfo(np.float32).min
DECODE_DTYPES = (np.float32, np.float16)  # the K/V element types the decode kernels read (float16 through its bits)
MEASURE_BYTES = 4 << 20  # the most keys (or values) block_sizes times with


class AttentionResult(NamedTuple):
    output: np.ndarray  # (n_queries, n_heads, head_dim) float32
    weights: np.ndarray  # (n_queries, n_heads, n_keys) float32; exactly 0 on masked keys
    # The cache's flat slot of each weight column, when the keys read were not the allocated prefix
    # of the pool (a disk tier, or a page selection); None: column i is flat slot i.
    slots: np.ndarray | None = None


def softmax(scores: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """Numerically stable softmax (the log-sum-exp shift by the row maximum).

    -inf entries get weight exactly 0. A row with no finite entry has nothing to normalise and
    comes back all zeros rather than NaN.
    """
    with np.errstate(over="ignore"):  # a huge negative score minus the max may round to -inf: weight 0
        out = np.subtract(scores, _finite(scores.max(axis=axis, keepdims=True)), out=out)
    np.exp(out, out=out)
    total = out.sum(axis=axis, keepdims=True)
    total[total == 0] = 1
    return np.divide(out, total, out=out)


def _finite(peak: np.ndarray) -> np.ndarray:
    """The row maxima to shift by: 0 where a row has no finite maximum (all masked)."""
    return np.where(np.isfinite(peak), peak, np.float32(0)).astype(np.float32, copy=False)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_bias: np.ndarray | None = None,
           key_positions: np.ndarray | None = None, q_positions: np.ndarray | None = None,
           window: int | None = None, all_weights: bool = True) -> AttentionResult:
    """Scaled dot-product attention of n queries over the given keys.

    q: (n, n_heads, d); keys, values: (n_kv_heads, T, d); key_bias: (T,) additive mask or None.
    With q_positions and key_positions, query i sees only keys at positions <= q_positions[i]
    (the causal mask of a prefill chunk), and with a `window` only those > q_positions[i] - window (a
    sliding-window layer). For a single decode query without a window every resident key is visible.
    Weights: every query's (n, n_heads, T) with `all_weights`, else the last query's only (1, n_heads, T).
    Queries go in blocks of `query_block` (query_blocks.py: a prefill's scores stay within SCORE_BYTES): each row's arithmetic is
    the same in any aligned block, so blocks change no bit of the result (with one BLAS thread, as pagevis runs).
    """
    n = q.shape[0]
    if takes_decode_kernel(q, keys, values):
        position = -1 if q_positions is None else int(q_positions[0])
        return attend_decode(q, np.ascontiguousarray(keys), np.ascontiguousarray(values), keys.shape[1], key_bias,
                             key_positions if window and position >= 0 else None, position, window)
    rows = query_block(q.shape[1], keys.shape[1], keys.shape[0])
    if rows >= n:  # one block
        weights, output, _, _ = _attention(q, keys, values, key_bias, key_positions, q_positions, window=window,
                                           last_only=not all_weights)
        return AttentionResult(_ungroup(output, n), _ungroup(weights, n) if all_weights else _last_row(weights, n))
    output = np.empty(q.shape, np.float32)
    every = np.empty((n, q.shape[1], keys.shape[1]), np.float32) if all_weights else None
    sizes = block_sizes(keys.shape[0], n * q.shape[1] // keys.shape[0], q.shape[2])  # the whole's (a short last
    # block would measure its own)
    for t0 in range(0, n, rows):
        t1 = min(t0 + rows, n)
        weights, part, _, _ = _attention(q[t0:t1], keys, values, key_bias, key_positions,
                                         None if q_positions is None else q_positions[t0:t1], sizes, window=window,
                                         causal=True, last_only=not all_weights)
        _ungroup_into(part, output[t0:t1])
        if every is not None:
            _ungroup_into(weights, every[t0:t1])
        elif t1 == n:
            every = _last_row(weights, t1 - t0)
        del weights, part  # (the next block's arrays take their place, not stack on them)
    assert every is not None
    return AttentionResult(output, every)


def _last_row(grouped: np.ndarray, n: int) -> np.ndarray:
    """The last query's (1, n_heads, ...) of a grouped (n_kv, n * group, ...) array, copied (the rest can go)."""
    n_kv, rows = grouped.shape[:2]
    group = rows // n
    return grouped[:, rows - group:].reshape(1, n_kv * group, *grouped.shape[2:]).copy()


def _ungroup_into(grouped: np.ndarray, out: np.ndarray) -> None:
    """out (n, n_heads, ...) = _ungroup(grouped, n), written in place (no whole copy beside it)."""
    n, n_heads = out.shape[:2]
    n_kv = grouped.shape[0]
    group = n_heads // n_kv
    rest = out.shape[2:]
    out.reshape(n, n_kv, group, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))[...] = grouped.reshape(
        n_kv, n, group, *rest)


_decode_kernel: ModuleType | None = None  # decode_kernel.py, once loaded


def load_decode_kernel() -> bool:
    """Load the decode kernel (decode_kernel.py: numba's cache, ~0.3 s of CPU; a first compile ~3.5 s;
    kernel_loader.import_kernels: under the compile lock, a damaged cache healed) now rather than in the first decode
    step; whether it was loaded by this call."""
    global _decode_kernel
    if _decode_kernel is not None:
        return False
    _decode_kernel = import_kernels("pagevis.kvcache.decode_kernel", "the decode attention kernel")
    return True


def takes_decode_kernel(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> bool:
    """Whether `attend` of these goes to the decode kernel: one query over some keys of one element type it reads
    (DECODE_DTYPES: float16 through its bits)."""
    return len(q) == 1 and keys.dtype == values.dtype and keys.dtype in DECODE_DTYPES and keys.shape[1] > 0


def batch_decode_kernels() -> ModuleType:
    """batch_decode_kernel.py (several sequences' decode attention through their block tables, and their K/V
    written in one call), imported on first use through kernel_loader.import_kernels."""
    return import_kernels("pagevis.kvcache.batch_decode_kernel", "the batched decode kernels")


def attend_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_keys: int, key_bias: np.ndarray | None,
                  key_positions: np.ndarray | None, position: int, window: int | None,
                  write: tuple[int, np.ndarray, np.ndarray] | None = None, pool: Any = None) -> AttentionResult:
    """`attend` of one query (q: (1, n_heads, d)) over the first n_keys slots of C-contiguous float32 or float16 keys
    and values (n_kv, S, d: a page pool's frames), read where they lie (float16 through its bits, converted exactly),
    in one numba call for every head (decode_kernel.py).
    key_bias: (S,) for every head, or (n_kv, S) one row a KV head (per-head masks), or None.
    key_positions: the slots' positions, with a `window` (else None). write: (slot, k, v), the new token's key and
    value (n_kv, d) written into that slot of keys and values first, in the same call (a decode step's). pool: the
    weights' spin pool (two threads) or None; with it and at least decode_kernel.SPLIT_KEYS keys, the keys are cut
    into parts shared with its helper thread and merged (decode_kernel.attend_split: the same bits whoever computes a
    part)."""
    load_decode_kernel()
    kernel = _decode_kernel
    assert kernel is not None
    n_heads, d = q.shape[1:]
    out = np.empty((1, n_heads, d), np.float32)
    weights = np.empty((1, n_heads, n_keys), np.float32)
    bias = kernel.NO_BIAS if key_bias is None else np.ascontiguousarray(
        key_bias.reshape(-1, key_bias.shape[-1])[:, :n_keys], dtype=np.float32)
    if window is not None and window > 0 and key_positions is not None:
        hidden = np.ascontiguousarray(key_positions[:n_keys], dtype=np.int64), window
    else:
        hidden = kernel.NO_POSITIONS, 0
    slot, k, v = (-1, kernel.NO_ROW, kernel.NO_ROW) if write is None else (
        write[0], np.ascontiguousarray(write[1], dtype=np.float32), np.ascontiguousarray(write[2], dtype=np.float32))
    query, scale = np.ascontiguousarray(q[0], dtype=np.float32), np.float32(1.0 / math.sqrt(d))
    kit = kernel.FLOAT32 if keys.dtype == np.float32 else kernel.half_kernels()
    keys, values = kernel.bits(keys), kernel.bits(values)
    if pool is not None and n_keys >= kernel.SPLIT_KEYS:
        kernel.attend_split(query, scale, keys, values, slot, k, v, n_keys, bias, hidden[0], position, hidden[1], out[0],
                            weights[0], pool, kernels=kit)
    else:
        kit.attend_one(query, scale, keys, values, slot, k, v, n_keys, bias, hidden[0], position, hidden[1], out[0],
                       weights[0])
    return AttentionResult(out, weights)


def attend_decode_batch(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_bias: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """One decode query for each of B sequences, each over its own keys, in one batched product per sweep
    (not B calls: at SmolLM2's size a decode step's attention was mostly Python per sequence and layer).

    q: (B, n_heads, d); keys, values: (n_kv, B, T, d), every sequence's keys padded to one length T, as a
    gather through B block tables gives them; key_bias: (B, T), 0 on resident keys, -inf on empty slots and
    padding. Returns the output (B, n_heads, d) float32 and the weights (B, n_heads, T), exactly 0 on masked
    keys; a sequence with no visible key gets zeros."""
    batch, n_heads, d = q.shape
    n_kv, _, n_keys, _ = keys.shape
    group = n_heads // n_kv
    scale = np.float32(1.0 / np.sqrt(d))
    grouped = np.multiply(q, scale, dtype=np.float32).reshape(batch, n_kv, group, d).transpose(1, 0, 2, 3)
    scores = np.matmul(grouped, keys.astype(np.float32, copy=False).transpose(0, 1, 3, 2))  # (n_kv, B, group, T)
    scores += key_bias[None, :, None, :]
    peak = np.maximum.reduce(scores, axis=-1, keepdims=True) if n_keys else np.full(
        scores.shape[:-1] + (1,), -np.inf, np.float32)
    with np.errstate(over="ignore"):
        np.subtract(scores, np.fmax(peak, LOWEST), out=scores)
    np.exp(scores, out=scores)
    total = np.maximum(np.add.reduce(scores, axis=-1, keepdims=True), np.float32(1))
    output = np.matmul(scores, values.astype(np.float32, copy=False))  # (n_kv, B, group, d)
    np.divide(scores, total, out=scores)
    np.divide(output, total, out=output)
    return (output.transpose(1, 0, 2, 3).reshape(batch, n_heads, d),
            scores.transpose(1, 0, 2, 3).reshape(batch, n_heads, n_keys))


class Partial(NamedTuple):
    """Attention over one part of the keys, in the form that merges exactly with other parts
    (the split-KV trick of flash-decoding)."""

    output: np.ndarray  # (n, n_heads, d) float32, normalised over this part's keys (0 if none visible)
    max: np.ndarray  # (n, n_heads) float32, the largest score; -inf when no key is visible
    total: np.ndarray  # (n, n_heads) float32, sum of exp(score - max); 0 when no key is visible


def attend_part(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_bias: np.ndarray | None = None,
                key_positions: np.ndarray | None = None, q_positions: np.ndarray | None = None,
                window: int | None = None) -> tuple[Partial, np.ndarray]:
    """`attend` over one part of the keys: its Partial and its weights (n, n_heads, T), normalised
    within the part (scale them by `rescale` to get the weights of the whole)."""
    n, n_heads, d = q.shape
    if keys.shape[1] == 0:
        nothing = np.zeros((n, n_heads), np.float32)
        return Partial(np.zeros((n, n_heads, d), np.float32), nothing - np.inf, nothing), np.zeros((n, n_heads, 0))
    weights, output, peak, total = _attention(q, keys, values, key_bias, key_positions, q_positions, window=window)
    part = Partial(_ungroup(output, n), _ungroup(peak, n), _ungroup(total, n))
    return part, _ungroup(weights, n)


def merge(a: Partial, b: Partial) -> Partial:
    """The attention over the union of two disjoint key sets, from theirs (log-sum-exp):
    m = max(m_a, m_b); l = l_a e^(m_a - m) + l_b e^(m_b - m); o = (o_a l_a e^(m_a - m) + o_b l_b e^(m_b - m)) / l."""
    peak = np.maximum(a.max, b.max)
    share_a, share_b = _share(a, peak), _share(b, peak)
    total = share_a + share_b
    safe = np.where(total > 0, total, 1)
    output = (a.output * (share_a / safe)[..., None] + b.output * (share_b / safe)[..., None]).astype(np.float32)
    return Partial(output, peak, total.astype(np.float32))


def rescale(part: Partial, whole: Partial) -> np.ndarray:
    """(n, n_heads) factor turning `part`'s weights into weights of `whole` (a merge that includes it)."""
    total = np.where(whole.total > 0, whole.total, 1)
    return (_share(part, whole.max) / total).astype(np.float32)


def _share(part: Partial, peak: np.ndarray) -> np.ndarray:
    """part.total * exp(part.max - peak), 0 where the part saw no key."""
    # (a -inf max minus a finite stand-in stays -inf: no invalid operation, so no errstate needed)
    shift = np.where(np.isfinite(part.max), part.max - np.where(np.isfinite(peak), peak, 0), -np.inf)
    return part.total * np.exp(shift)


def _attention(q, keys, values, key_bias, key_positions, q_positions, blocks=None, chunk_bytes=CHUNK_BYTES,
               window=None, causal=False, last_only=False):
    """The kernel (see the module docstring). Returns, grouped (n_kv, rows, ...): the weights (rows, T),
    normalised; the output (rows, d), normalised; each row's largest score (-inf: no key visible) and its
    sum of exp(score - max) (0: no key visible). `blocks` (score block, value block) overrides the measured
    sizes; chunk_bytes the float16 chunk length (tests use both to reach every path). causal: mask by positions
    even a single query (a block of a prefill's; a lone decode query sees every resident key). last_only: only the
    last query's weights are normalised (its `group` rows of each KV head; the others are left unnormalised: the
    caller keeps the last query's only)."""
    n, n_heads, d = q.shape
    n_kv, n_keys, _ = keys.shape
    group = n_heads // n_kv
    rows = n * group
    scale = np.float32(1.0 / np.sqrt(d))
    # (n, n_heads, d) -> (n_kv, n * group, d): each KV head's queries as one matrix for one product.
    grouped = np.multiply(q, scale, dtype=np.float32)
    grouped = grouped.reshape(n_kv, rows, d) if n == 1 else np.ascontiguousarray(
        grouped.reshape(n, n_kv, group, d).transpose(1, 0, 2, 3).reshape(n_kv, rows, d))
    score_block, value_block = blocks or block_sizes(n_kv, rows, d)
    convert = keys.dtype != np.float32 or values.dtype != np.float32
    step = max(1, chunk_bytes // (4 * n_kv * d)) if convert else max(n_keys, 1)
    buffer = np.empty((n_kv, min(step, n_keys), d), np.float32) if convert else None
    scores = np.empty((n_kv, rows, n_keys), np.float32)
    for lo in range(0, n_keys, step):  # sweep 1: the keys, once per KV head
        _block_product(grouped, _as_float32(keys[:, lo:lo + step], buffer).transpose(0, 2, 1),
                       scores[:, :, lo:lo + step], score_block)
    if q_positions is not None and key_positions is not None and (n > 1 or window or causal):
        hidden = position_mask(key_positions, q_positions, window)  # (0 or -inf: with the bias folded in, the
        if key_bias is not None:  # same sums as adding each in turn)
            hidden += key_bias
        scores.reshape(n_kv, n, group, n_keys)[...] += hidden[None, :, None, :]
    elif key_bias is not None:
        scores += key_bias
    peak = np.maximum.reduce(scores, axis=-1, keepdims=True) if n_keys else np.full((n_kv, rows, 1), -np.inf,
                                                                                    np.float32)
    with np.errstate(over="ignore"):  # a huge negative score minus the max: -inf, weight 0
        # a row with no visible key (max -inf) shifts by the lowest float instead: its -inf scores stay -inf
        np.subtract(scores, np.fmax(peak, LOWEST), out=scores)
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)
    output = None
    for lo in range(0, n_keys, step):  # sweep 2: the values, once per KV head, times the unnormalised weights
        part = _block_product(scores[:, :, lo:lo + step], _as_float32(values[:, lo:lo + step], buffer), None,
                              value_block)
        output = part if output is None else np.add(output, part, out=output)
    if output is None:
        output = np.zeros((n_kv, rows, d), np.float32)
    divisor = np.maximum(total, np.float32(1))  # a row's total is >= 1 if it sees a key (its max: exp 0), else 0
    if last_only:
        np.divide(scores[:, rows - group:], divisor[:, rows - group:], out=scores[:, rows - group:])
    else:
        np.divide(scores, divisor, out=scores)
    np.divide(output, divisor, out=output)
    return scores, output, peak[..., 0], total[..., 0]


def position_mask(key_positions: np.ndarray, q_positions: np.ndarray, window: int | None) -> np.ndarray:
    """(n_queries, n_keys) float32: -inf where query i must not see key j (a later position, or with a window
    one at or below q_positions[i] - window), else 0."""
    hidden = key_positions[None, :] > q_positions[:, None]
    if window:
        hidden |= key_positions[None, :] <= q_positions[:, None] - window
    return np.where(hidden, np.float32(-np.inf), np.float32(0))


def _as_float32(array: np.ndarray, buffer: np.ndarray | None) -> np.ndarray:
    """array in float32: itself, or converted into the front of the reused buffer."""
    if array.dtype == np.float32:
        return array
    if buffer is None:
        return array.astype(np.float32)
    view = buffer[:, :array.shape[1]]
    np.copyto(view, array)
    return view


def _block_product(a: np.ndarray, b: np.ndarray, out: np.ndarray | None, block: int) -> np.ndarray:
    """a (n_kv, rows, k) @ b (n_kv, k, cols) per KV head. With a block, the inner dimension of the output
    (the keys: out is given, cols split) or of the sum (the values: out is None, k split) is cut into blocks
    that np.matmul runs one after another in C, small products that BLAS does not pack."""
    if out is not None:  # scores: (n_kv, rows, d) @ (n_kv, d, keys) -> out (n_kv, rows, keys)
        n_kv, rows, width = out.shape
        body = width // block * block if block else 0
        if body >= 2 * block > 0:
            blocks = b[:, :, :body].reshape(n_kv, b.shape[1], body // block, block).transpose(0, 2, 1, 3)
            np.matmul(a[:, None], blocks, out=out[:, :, :body].reshape(n_kv, rows, -1, block).transpose(0, 2, 1, 3))
            if body < width:
                np.matmul(a, b[:, :, body:], out=out[:, :, body:])
        else:
            np.matmul(a, b, out=out)
        return out
    n_kv, rows, width = a.shape  # values: (n_kv, rows, keys) @ (n_kv, keys, d) -> (n_kv, rows, d)
    body = width // block * block if block else 0
    if body < 2 * block or not block:
        return np.matmul(a, b)
    parts = np.matmul(a[:, :, :body].reshape(n_kv, rows, -1, block).transpose(0, 2, 1, 3),
                      b[:, :body].reshape(n_kv, -1, block, b.shape[2]))
    result = parts.sum(axis=1)
    if body < width:
        result += np.matmul(a[:, :, body:], b[:, body:])
    return result


@lru_cache(maxsize=256)
def block_sizes(n_kv: int, rows: int, d: int, n_keys: int = 4096, repeats: int = 2) -> tuple[int, int]:
    """Keys per block for the score product and for the value product, measured once per shape on random
    data (tens of ms: at most MEASURE_BYTES of keys, whatever the shape): the fastest of BLOCK_CANDIDATES.
    (0, 0), plain gemm, without measuring: above DECODE_ROWS rows, or heads so wide that the budget holds
    too few keys to cut into blocks."""
    n_keys = min(n_keys, MEASURE_BYTES // (4 * n_kv * d))
    if rows > DECODE_ROWS or n_keys < 2 * max(BLOCK_CANDIDATES):
        return 0, 0
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n_kv, rows, d), dtype=np.float32)
    keys = rng.standard_normal((n_kv, n_keys, d), dtype=np.float32).transpose(0, 2, 1)  # as the cache holds them
    weights = rng.random((n_kv, rows, n_keys), dtype=np.float32)
    values = rng.standard_normal((n_kv, n_keys, d), dtype=np.float32)
    out = np.empty((n_kv, rows, n_keys), np.float32)

    def fastest(run) -> int:
        times = {}
        for block in BLOCK_CANDIDATES:
            best = np.inf
            for _ in range(repeats):
                start = time.perf_counter()
                run(block)
                best = min(best, time.perf_counter() - start)
            times[block] = best
        return min(times, key=lambda block: times[block])

    return (fastest(lambda block: _block_product(a, keys, out, block)),
            fastest(lambda block: _block_product(weights, values, None, block)))


def _ungroup(array: np.ndarray, n: int) -> np.ndarray:
    """(n_kv, n * group, ...) -> (n, n_heads, ...): back from the grouped layout of `_attention`."""
    n_kv, rows = array.shape[:2]
    group = rows // n
    rest = array.shape[2:]
    if n == 1:
        return array.reshape(1, rows * n_kv, *rest)
    return array.reshape(n_kv, n, group, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(
        n, n_kv * group, *rest)

"""Attention kernels over key/value arrays laid out (n_kv_heads, n_keys, head_dim).

The paged cache calls `attend` on a view of its pool's allocated prefix, with an additive bias that is
0 for resident slots and -inf for empty ones; a dense caller passes contiguous arrays and a zero bias.
Grouped-query (and multi-query) attention: query head h reads KV head h // (n_heads // n_kv_heads).
Float16 storage is read in float32; all arithmetic is float32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class AttentionResult(NamedTuple):
    output: np.ndarray  # (n_queries, n_heads, head_dim) float32
    weights: np.ndarray  # (n_queries, n_heads, n_keys) float32; exactly 0 on masked keys


def softmax(scores: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """Numerically stable softmax (the log-sum-exp shift by the row maximum).

    -inf entries get weight exactly 0. A row with no finite entry has nothing to normalise and
    comes back all zeros rather than NaN.
    """
    with np.errstate(over="ignore"):  # a huge negative score minus the max may round to -inf: weight 0
        out = np.subtract(scores, _finite_max(scores, axis), out=out)
    np.exp(out, out=out)
    total = out.sum(axis=axis, keepdims=True)
    total[total == 0] = 1
    return np.divide(out, total, out=out)


def _finite_max(scores: np.ndarray, axis: int) -> np.ndarray:
    peak = scores.max(axis=axis, keepdims=True)
    peak[~np.isfinite(peak)] = 0
    return peak


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_bias: np.ndarray | None = None,
           key_positions: np.ndarray | None = None, q_positions: np.ndarray | None = None
           ) -> AttentionResult:
    """Scaled dot-product attention of n queries over the given keys.

    q: (n, n_heads, d); keys, values: (n_kv_heads, T, d); key_bias: (T,) additive mask or None.
    With q_positions and key_positions, query i sees only keys at positions <= q_positions[i]
    (the causal mask of a prefill chunk). For a single decode query every resident key is visible.
    """
    n, n_heads, d = q.shape
    n_kv, n_keys, _ = keys.shape
    group = n_heads // n_kv
    if keys.dtype != np.float32:
        keys = keys.astype(np.float32)
        values = values.astype(np.float32)
    scale = np.float32(1.0 / np.sqrt(d))
    # (n, n_heads, d) -> (n_kv, n * group, d): each KV head's queries as one matrix for one matmul.
    grouped = (q * scale).reshape(n, n_kv, group, d).transpose(1, 0, 2, 3).reshape(n_kv, n * group, d)
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # (n_kv, n * group, T)
    if key_bias is not None:
        scores += key_bias
    if q_positions is not None and n > 1:
        future = np.where(key_positions[None, :] > q_positions[:, None], -np.inf, 0).astype(np.float32)
        scores.reshape(n_kv, n, group, n_keys)[...] += future[None, :, None, :]
    weights = softmax(scores, out=scores)
    output = np.matmul(weights, values)  # (n_kv, n * group, d)
    output = output.reshape(n_kv, n, group, d).transpose(1, 0, 2, 3).reshape(n, n_heads, d)
    weights = weights.reshape(n_kv, n, group, n_keys).transpose(1, 0, 2, 3).reshape(n, n_heads, n_keys)
    return AttentionResult(output, weights)

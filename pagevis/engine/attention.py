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
    # The cache's flat slot of each weight column, when the keys read were not the allocated prefix
    # of the pool (a disk tier, or a page selection); None: column i is flat slot i.
    slots: np.ndarray | None = None


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
    scores, values = _scores(q, keys, values, key_bias, key_positions, q_positions)
    weights = softmax(scores, out=scores)
    return AttentionResult(_ungroup(np.matmul(weights, values), q.shape[0]), _ungroup(weights, q.shape[0]))


class Partial(NamedTuple):
    """Attention over one part of the keys, in the form that merges exactly with other parts
    (the split-KV trick of flash-decoding)."""

    output: np.ndarray  # (n, n_heads, d) float32, normalised over this part's keys (0 if none visible)
    max: np.ndarray  # (n, n_heads) float32, the largest score; -inf when no key is visible
    total: np.ndarray  # (n, n_heads) float32, sum of exp(score - max); 0 when no key is visible


def attend_part(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_bias: np.ndarray | None = None,
                key_positions: np.ndarray | None = None, q_positions: np.ndarray | None = None
                ) -> tuple[Partial, np.ndarray]:
    """`attend` over one part of the keys: its Partial and its weights (n, n_heads, T), normalised
    within the part (scale them by `rescale` to get the weights of the whole)."""
    n, n_heads, d = q.shape
    if keys.shape[1] == 0:
        nothing = np.zeros((n, n_heads), np.float32)
        return Partial(np.zeros((n, n_heads, d), np.float32), nothing - np.inf, nothing), np.zeros((n, n_heads, 0))
    scores, values = _scores(q, keys, values, key_bias, key_positions, q_positions)
    peak = scores.max(axis=-1, keepdims=True)
    finite = np.isfinite(peak)
    with np.errstate(over="ignore", invalid="ignore"):
        np.subtract(scores, np.where(finite, peak, 0), out=scores)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    np.divide(scores, np.where(total > 0, total, 1), out=scores)
    output = np.matmul(scores, values)
    part = Partial(_ungroup(output, n), _ungroup(peak[..., 0], n), _ungroup(total[..., 0], n))
    return part, _ungroup(scores, n)


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


def _scores(q, keys, values, key_bias, key_positions, q_positions):
    """Scaled scores (n_kv, n * group, T) with masks applied, and the values in float32."""
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
    return scores, values


def _ungroup(array: np.ndarray, n: int) -> np.ndarray:
    """(n_kv, n * group, ...) -> (n, n_heads, ...): back from the grouped layout of `_scores`."""
    n_kv, rows = array.shape[:2]
    group = rows // n
    rest = array.shape[2:]
    return array.reshape(n_kv, n, group, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(
        n, n_kv * group, *rest)

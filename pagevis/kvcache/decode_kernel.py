"""Decode attention in one numba call per layer: one query token, every head, K/V read where they lie.

`attend_one(q, k, v, n_keys, bias, key_positions, position, window, out, weights)`:
  q (n_heads, d) float32, already scaled by 1/sqrt(d); k, v (n_kv, S, d) float32, C-contiguous: the pool's
  frames as one array (a page-store's (n_kv, pages, page_size, d) reshaped, free), of which the first n_keys
  slots are read; bias (n_keys,) additive (0 resident, -inf empty) or empty; with window > 0, key_positions
  (n_keys,) and the query's position: keys at or below position - window (or after it) are hidden.
  Writes out (n_heads, d) and weights (n_heads, n_keys), normalised, exactly 0 on hidden keys; a head that
  sees no key gets zeros.
Query head h reads KV head h // group: each key and value row is read once for the group's heads together (GQA).
Two sweeps per KV head, as attention_kernels.py's kernel: the scores, then softmax, then the values weighted. The dot
products may be summed in any order (fastmath reassoc: vectorised), so a score differs from NumPy's by float32
rounding only; the float64 reference tests and paged = dense hold it to that.

Compiled once with an explicit signature and kept in numba's on-disk cache (cache=True), as the weight kernels
are (model/weight_kernels.py); this module is imported on the first decode step that uses it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_SIGNATURE = ("void(float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], int64, float32[::1], int64[::1], "
              "int64, int64, float32[:, ::1], float32[:, ::1])")


@njit(_SIGNATURE, cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy", boundscheck=False)
def attend_one(q, k, v, n_keys, bias, key_positions, position, window, out, weights):  # pragma: no cover (numba)
    n_heads, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    has_bias = bias.shape[0] > 0
    lowest = position - window
    for h in range(n_kv):
        first = h * group
        for t in range(n_keys):
            hidden = window > 0 and (key_positions[t] <= lowest or key_positions[t] > position)
            for g in range(first, first + group):
                if hidden:
                    weights[g, t] = -np.inf
                    continue
                s = np.float32(0)
                for j in range(d):
                    s += q[g, j] * k[h, t, j]
                if has_bias:
                    s += bias[t]
                weights[g, t] = s
        for g in range(first, first + group):
            peak = -np.inf
            for t in range(n_keys):
                if weights[g, t] > peak:
                    peak = weights[g, t]
            for j in range(d):
                out[g, j] = 0
            if peak == -np.inf:  # no key visible
                for t in range(n_keys):
                    weights[g, t] = 0
                continue
            total = np.float32(0)
            for t in range(n_keys):
                e = np.float32(math.exp(weights[g, t] - peak))
                weights[g, t] = e
                total += e
            inverse = np.float32(1) / total
            for t in range(n_keys):
                weights[g, t] *= inverse
        for t in range(n_keys):
            for g in range(first, first + group):
                w = weights[g, t]
                if w != 0:
                    for j in range(d):
                        out[g, j] += w * v[h, t, j]


NO_BIAS = np.zeros(0, np.float32)
NO_POSITIONS = np.zeros(0, np.int64)

"""Independent references for engine tests: float64 dense attention over an explicit token list."""

import numpy as np


def dense_attention_f64(q, keys, values):
    """q: (n_heads, d); keys/values: (T, n_kv, d) for the resident tokens. Returns (out, weights)."""
    q = np.asarray(q, np.float64)
    keys = np.asarray(keys, np.float64)
    values = np.asarray(values, np.float64)
    n_heads, d = q.shape
    group = n_heads // keys.shape[1]
    out = np.zeros((n_heads, d))
    weights = np.zeros((n_heads, keys.shape[0]))
    for h in range(n_heads):
        kv = h // group
        scores = keys[:, kv, :] @ q[h] / np.sqrt(d)
        e = np.exp(scores - scores.max())
        weights[h] = e / e.sum()
        out[h] = weights[h] @ values[:, kv, :]
    return out, weights


"""Independent references for engine tests: float64 dense attention over an explicit token list."""

import os

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



def windowed_attention_f64(q, q_position, tokens, window):
    """float64 attention of one query (n_heads, d) at q_position over `tokens` {position: (k, v)}, each
    (n_kv, d), seeing only positions q_position - window < p <= q_position (None: every p <= q_position)."""
    seen = sorted(p for p in tokens if p <= q_position and (window is None or p > q_position - window))
    keys = np.stack([tokens[p][0] for p in seen])
    values = np.stack([tokens[p][1] for p in seen])
    return dense_attention_f64(q, keys, values)[0], seen


class WindowedDenseAttend:
    """A float64 attend() for a model's forward pass: keeps every K/V, masks causally and by each layer's
    window (None: full attention). Shares no code with the cache."""

    def __init__(self, windows):
        self.windows = windows
        self.tokens = [dict() for _ in windows]

    def __call__(self, layer, q, k, v, positions):
        for i, position in enumerate(positions.tolist()):
            self.tokens[layer][position] = (k[i], v[i])
        return np.stack([windowed_attention_f64(q[i], position, self.tokens[layer], self.windows[layer])[0]
                         for i, position in enumerate(positions.tolist())]).astype(np.float32)


def weight_positions(cache, layer, result):
    """Token position of each weight column of an `attend` result: over its `slots`, or (None) over the pool's
    allocated prefix (`slot_positions`)."""
    if result.slots is None:
        return cache.slot_positions(layer)
    return cache.stores[layer].positions[result.slots]


def page_kv(store, page):
    """Keys and values (n_kv, page_size, head_dim) float32 of one page as attention reads them: from its RAM
    frame, or else straight from the disk tier's file (nothing moves, nothing is counted)."""
    frame = int(store.frame_of[page])
    if frame >= 0:
        keys, values = store.frame_kv(frame, frame + 1)
        return keys.astype(np.float32), values.astype(np.float32)
    swap = store.tier.swap
    block = np.frombuffer(os.pread(swap.fd, swap.page_bytes, page * swap.page_bytes), np.uint8)
    if not store.quantized:
        kv = block.view(store.k.dtype).reshape(2, store.n_kv, store.page_size, store.head_dim)
        return kv[0].astype(np.float32), kv[1].astype(np.float32)
    return store._dequantize(store.layout.views(block[None].copy()), np.array([page]))

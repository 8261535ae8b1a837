"""DenseAttention: the plain reference for the attend() seam — keep every K/V, mask causally."""

from __future__ import annotations

import numpy as np

from pagevis.model.config import ModelConfig
from pagevis.model.weight_threads import split
from pagevis.query_blocks import query_block


class _LayerCache:
    """Growing contiguous K, V and position arrays for one layer (capacity doubles when full)."""

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        self.length = 0
        self.keys = np.empty((16, n_kv_heads, head_dim), dtype=np.float32)
        self.values = np.empty_like(self.keys)
        self.positions = np.empty(16, dtype=np.int64)
        self.newest = -1  # the largest position stored

    def append(self, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        end = self.length + len(k)
        if end > len(self.keys):
            capacity = max(end, 2 * len(self.keys))
            self.keys = _grown(self.keys, capacity)
            self.values = _grown(self.values, capacity)
            self.positions = _grown(self.positions, capacity)
        self.keys[self.length:end] = k
        self.values[self.length:end] = v
        self.positions[self.length:end] = positions
        self.length = end
        self.newest = max(self.newest, int(positions.max()))


def _grown(array: np.ndarray, capacity: int) -> np.ndarray:
    bigger = np.empty((capacity, *array.shape[1:]), dtype=array.dtype)
    bigger[:len(array)] = array
    return bigger


class DenseAttention:
    """An AttendFn holding all keys and values of every layer, with no eviction.

    A query at position p attends to every stored key whose position is <= p (so tokens fed
    together in one forward call see each other causally) and, in a layer with a sliding window w
    (config.sliding_windows), > p - w: the w latest positions, its own included (llama.cpp's and
    transformers' rule). It still stores every key: it is the reference, not a bounded cache.
    Scores are scaled by 1/sqrt(head_dim); softmax runs in float32.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._layers = [_LayerCache(config.n_kv_heads, config.head_dim) for _ in range(config.n_layers)]
        self._scale = np.float32(1.0 / np.sqrt(config.head_dim))

    def __len__(self) -> int:
        """Tokens stored (in layer 0)."""
        return self._layers[0].length

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 positions: np.ndarray) -> np.ndarray:
        cache = self._layers[layer]
        cache.append(k, v, positions)
        n, n_heads = q.shape[:2]
        out = np.empty_like(q, dtype=np.float32)
        block = query_block(n_heads, cache.length, cache.keys.shape[1])  # (as the paged cache blocks them)

        def work(t0: int, t1: int, private: bool) -> np.ndarray | None:
            target = np.empty((t1 - t0, *q.shape[1:]), np.float32) if private else out[t0:t1]
            for b0 in range(t0, t1, block):
                b1 = min(t1, b0 + block)
                # a short last block is computed whole, over the queries before it too: BLAS may take another
                # kernel for a short product (OpenBLAS's small-matrix one on Intel's AVX-512 cores), whose rows
                # round differently from the whole product's
                start = max(0, b1 - block)
                target[b0 - t0:b1 - t0] = self._attend(layer, q[start:b1], positions[start:b1])[b0 - start:]
            return target if private else None

        def place(t0: int, t1: int, part: np.ndarray) -> None:
            out[t0:t1] = part

        # a prefill's queries in two halves on the weight threads (NumPy releases the GIL in these products);
        # the cost passed is the scores' bytes, so decoding's one query stays on the caller
        split(n, 4 * n * n_heads * cache.length, work, place)
        return out

    def _attend(self, layer: int, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cache = self._layers[layer]
        keys = cache.keys[:cache.length]
        values = cache.values[:cache.length]
        n, n_heads, head_dim = q.shape
        n_kv = keys.shape[1]
        group = n_heads // n_kv
        # (kv_head, n * group, head_dim): the query heads that share a KV head, for all n tokens.
        grouped_q = (q * self._scale).reshape(n, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(
            n_kv, n * group, head_dim)
        scores = grouped_q @ keys.transpose(1, 2, 0)  # (kv_head, n * group, length)
        window = self.config.sliding_windows[layer]
        stored = cache.positions[:cache.length][None, :]
        query_positions = np.repeat(positions, group)[:, None]
        # masked with copyto's where, not boolean indexing: for a 512-token prefill of Gemma that was 13 ms a
        # layer against 1 (the indexing materialises the masked elements' indices)
        if window is not None and stored.min() <= positions.max() - window:  # keys left some query's window
            hidden = (stored > query_positions) | (stored <= query_positions - window)
            np.copyto(scores, np.float32(-np.inf), where=hidden)
        elif positions.min() < cache.newest:  # some query has keys after it: mask them
            np.copyto(scores, np.float32(-np.inf), where=stored > query_positions)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = scores @ values.transpose(1, 0, 2)  # (kv_head, n * group, head_dim)
        return out.reshape(n_kv, n, group, head_dim).transpose(1, 0, 2, 3).reshape(n, n_heads, head_dim)

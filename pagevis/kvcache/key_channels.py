"""ThinK: key channels pruned per layer and KV head, not tokens (Xu et al. 2024, "ThinK: Thinner Key Cache by
Query-Driven Pruning", arXiv:2407.21018; kvpress's `ThinKPress`, kvpress/presses/think_press.py).

Each of a KV head's head_dim key channels c is scored as kvpress scores it: the mean square of the observation
window's queries on c (the last WINDOW queries, after RoPE, averaged over the KV head's query heads) times the
mean square of the cached keys on c. The `int(head_dim * ratio)` lowest channels are pruned: set to zero in
every key the sequence holds then and in every key written afterwards, so attention is exactly the attention
over the pruned keys. Values are untouched.

When: kvpress scores once, after the prompt (its window = the prompt's last 32 queries). Here the channels of
each layer are chosen once per sequence, after the step that finishes its prompt or fills its cache (whichever
comes first: a text streamed through a bounded cache, as compare feeds it, is a prompt longer than the cache),
from the last WINDOW queries that layer attended with and the keys it holds then. Until then keys are whole.

Memory: kvpress zeroes the channels and keeps full-width keys; the paper stores the narrower keys. The store
here is shared by every sequence of a pool, and each sequence chooses its own channels, so its arrays stay full
width with zeros too; the bytes reported (`CacheConfig.kv_bytes_per_token`) are the ones a store of the kept
channels alone would need, and reports say that the arrays here are full width.
"""

from __future__ import annotations

import numpy as np

WINDOW = 32  # kvpress's window_size: the queries that score the channels


def pruned_count(head_dim: int, ratio: float) -> int:
    """Channels pruned per KV head: kvpress's int(head_dim * key_channel_compression_ratio)."""
    return int(head_dim * ratio)


def channel_scores(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(n_kv, head_dim) float64: the window's mean square query per channel, averaged over each KV head's query
    heads, times the keys' mean square per channel. queries (n, n_heads, d); keys (n_kv, n_keys, d)."""
    n_kv, _, d = keys.shape
    queries = np.asarray(queries, np.float64)
    query_power = np.mean(queries ** 2, axis=0).reshape(n_kv, -1, d).mean(axis=1)
    key_power = np.mean(np.asarray(keys, np.float64) ** 2, axis=1)
    return query_power * key_power


def kept_channels(scores: np.ndarray, n_pruned: int) -> np.ndarray:
    """(n_kv, head_dim) bool: True on the channels kept, False on each KV head's n_pruned lowest scores (ties:
    the lower channel goes first)."""
    kept = np.ones(scores.shape, dtype=bool)
    lowest = np.argsort(scores, axis=1, kind="stable")[:, :n_pruned]
    np.put_along_axis(kept, lowest, False, axis=1)
    return kept


class KeyChannels:
    """One sequence's ThinK state: per layer its last WINDOW queries until the channels are chosen, then the
    (n_kv, head_dim) mask of the channels kept."""

    def __init__(self, n_layers: int, ratio: float, head_dim: int):
        self.n_pruned = pruned_count(head_dim, ratio)
        self.queries: list[np.ndarray | None] = [None] * n_layers
        self.kept: list[np.ndarray | None] = [None] * n_layers

    @property
    def chosen(self) -> bool:
        return self.kept[0] is not None

    def reset(self) -> None:
        self.queries = [None] * len(self.queries)
        self.kept = [None] * len(self.kept)

    def observe(self, layer: int, q: np.ndarray) -> None:
        """Queries (n, n_heads, d) a layer attended with: the newest WINDOW are kept until the choice."""
        if self.kept[layer] is None:
            seen = q if self.queries[layer] is None else np.concatenate([self.queries[layer], q])
            self.queries[layer] = seen[-WINDOW:].copy()

    def choose(self, layer: int, keys: np.ndarray) -> np.ndarray:
        """The layer's kept channels from its window and its keys (n_kv, n_keys, d); the window is dropped."""
        queries = self.queries[layer]
        if queries is None:
            raise RuntimeError(f"layer {layer}'s key channels are chosen before it attended with any query")
        kept = self.kept[layer] = kept_channels(channel_scores(queries, keys), self.n_pruned)
        self.queries[layer] = None
        return kept

    def prune(self, layer: int, k: np.ndarray) -> np.ndarray:
        """Keys (n, n_kv, d) as the layer stores them: the pruned channels zeroed once chosen."""
        kept = self.kept[layer]
        return k if kept is None else np.where(kept, k, 0).astype(k.dtype, copy=False)

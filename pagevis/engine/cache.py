"""The paged KV cache: per-layer page pools, the eviction policy, events, and paged attention."""

from __future__ import annotations

import numpy as np

from .attention import AttentionResult, attend
from .config import CacheConfig
from .events import CacheEvent
from .pages import LayerPages
from .policies import EvictionPolicy, make_policy


class PagedKVCache:
    """K/V for every layer in fixed-size pages. Tokens keep their absolute positions; when a layer is
    full, its policy chooses which tokens leave. Every change is recorded as a CacheEvent.

    Per step the caller sets `step`, then per layer: `append` the new tokens' K/V, then `attend`.
    `attend` hands the attention weights to the policy state (accumulated and latest attention) when
    the policy scores by attention.
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.policy: EvictionPolicy = make_policy(config)
        self.layers = [LayerPages(config, layer) for layer in range(config.n_layers)]
        self.step = 0
        self.events: list[CacheEvent] = []

    def reset(self) -> None:
        for pages in self.layers:
            pages.reset()
        self.policy.reset()
        self.step = 0
        self.events = []

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def free_slots(self) -> int:
        """Tokens every layer can take before its policy must evict."""
        return min(pages.free_slots() for pages in self.layers)

    def can_append(self, n: int) -> bool:
        """Whether n more tokens fit, by eviction if the policy evicts. Check before a step so that a
        full cache fails before any layer has changed."""
        return self.policy.evicts or self.free_slots() >= n

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions, evicting as needed."""
        pages = self.layers[layer]
        for i, position in enumerate(positions):
            if pages.free_slots() == 0:
                self._evict(pages)
            flat = pages.take_slot(self.step, self.events)
            pages.write(flat, k[i], v[i], int(position), self.step, self.events)

    def ensure_room(self, n: int) -> None:
        if not self.can_append(n):
            self.policy.choose_victims(self.layers[0])  # raises the policy's CacheFullError

    def _evict(self, pages: LayerPages) -> None:
        victims, scores = self.policy.choose_victims(pages)
        for flat, score in zip(victims.tolist(), scores.tolist()):
            pages.evict(flat, self.step, self.policy.name, self.policy.reason, score, self.events)

    def attend(self, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention of n queries (n, n_heads, head_dim) at `positions` over the layer's resident tokens.

        Weights come back over the flat slots of the allocated prefix of the pool,
        (n, n_heads, high_water * page_size), zero on empty slots; `slot_positions(layer)` maps them.
        """
        pages = self.layers[layer]
        n_slots = pages.high_water * pages.page_size
        n_kv, _, _, head_dim = pages.k.shape
        keys = pages.k[:, : pages.high_water].reshape(n_kv, n_slots, head_dim)
        values = pages.v[:, : pages.high_water].reshape(n_kv, n_slots, head_dim)
        # With no empty slot below the high-water mark the occupancy mask is all zeros: skip it.
        bias = None if pages.resident == n_slots else pages.bias[:n_slots]
        result = attend(q, keys, values, bias, pages.positions[:n_slots], positions)
        if self.policy.uses_attention:
            self._observe(pages, result.weights)
        return result

    @staticmethod
    def _observe(pages: LayerPages, weights: np.ndarray) -> None:
        """Hand the step's attention (mean over heads) to the score-based policies' state."""
        n_queries, n_heads, n_slots = weights.shape
        last = weights[-1].sum(axis=0)
        last /= n_heads
        pages.last[:n_slots] = last
        pages.accumulated[:n_slots] += last if n_queries == 1 else weights.sum(axis=(0, 1)) / n_heads

    def slot_positions(self, layer: int) -> np.ndarray:
        """Token position of each flat slot in the allocated prefix (what `attend`'s weights index)."""
        pages = self.layers[layer]
        return pages.positions[: pages.high_water * pages.page_size]

    def resident_positions(self, layer: int) -> np.ndarray:
        positions = self.layers[layer].positions
        return np.sort(positions[positions >= 0])

"""KVzip: query-agnostic compression of the prompt's cache, scored by a reconstruction pass.

Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, arXiv:2505.23416;
read in kvpress's `KVzipPress` (kvpress/presses/kvzip_press.py), not copied.

The prompt is prefilled whole (nothing is evicted: the pool must hold it). The engine then feeds the
reconstruction prompt — "Repeat the previous context exactly." and the prompt again, teacher-forced, in
chunks (pagevis.engine.reconstruct) — through a read-only forward: its queries read the cache and the
chunk's own earlier tokens, and none of its tokens is written. Each cached (KV head, token) entry scores the
largest attention any reconstruction query of that KV head's query group paid it (`ReconstructionScores`).
`compress` then keeps the `budget` x n_layers x n_kv_heads best entries over all layers and KV heads at
once (one global threshold, kvpress's `layerwise=False`), so each (layer, KV head) gets its own budget; the
cache masks the dropped entries per head and frees the slots every head dropped.

kvpress's `compression_ratio` r removes r x (the context's entries); here `budget` B keeps B tokens' worth
per layer on average: r = 1 - B / (prompt tokens). With `context` N the compression comes after the prompt's
first N tokens, and the rest of the prompt is fed one token at a time as if decoded (compare's row). The first `n_sink` positions are always kept (kvpress
gives them the score 1.0, the largest a weight can be; it overwrites them when the context has no
chat-template prefix, here they stay: n_sink=0 is the bare score).

After compression each (layer, KV head) keeps its count: before a decoded token is written, a head at its
budget drops its lowest entry, ranking the prompt's entries by their KVzip score below every decoded token,
and decoded tokens oldest first (sinks never). So decoding eats the least-attended context first, then
slides over its own tokens. A head holding only its sinks keeps the newest token one step more than its
budget (it has nothing else to drop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policies.base import EvictionPolicy, bound
from pagevis.kvcache.policy_state import LayerView, PolicyState

DECODED = 2.0  # a decoded token's value is DECODED + its position: above every attention weight (<= 1)


class ReconstructionScores(PolicyState):
    """Per slot and KV head, the largest attention a reconstruction query of that head's group paid it."""

    def __init__(self, n_slots: int, n_kv_heads: int):
        super().__init__(n_slots)
        self.scores = self.add_array("scores", width=(n_kv_heads,))

    def reconstruct(self, weights: np.ndarray, slots: np.ndarray) -> None:
        """One reconstruction call's weights (n_queries, n_heads, len(slots)) over these flat slots."""
        n, n_heads, m = weights.shape
        n_kv = self.scores.shape[1]
        best = weights.reshape(n, n_kv, n_heads // n_kv, m).max(axis=(0, 2))  # (n_kv, m)
        self.scores[slots] = np.maximum(self.scores[slots], best.T)


@dataclass
class KVzip(EvictionPolicy):
    budget: int | None = None  # tokens per layer kept on average: budget x n_layers x n_kv_heads entries
    n_sink: int = 4
    chunk: int = 2048  # prompt tokens per reconstruction chunk (kvpress's chunk_size)
    context: int = 0  # compress after this many tokens (0: the whole prompt); compare's row sets it
    per_head = True
    compresses = True
    name = "kvzip"
    citation = ("KVzip: Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, "
                "arXiv:2505.23416 (as kvpress's KVzipPress, layerwise=False).")
    reason = "lowest reconstruction attention over all layers and KV heads"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.n_sink = self.check_int_param("n_sink", self.n_sink, 0, capacity)
        self.chunk = self.check_int_param("chunk", self.chunk, 1, 1 << 20)
        self.context = self.check_int_param("context", self.context, 0, capacity)
        self.budget = self.check_int_param("budget", capacity // 2 if self.budget is None else self.budget,
                                           max(1, self.n_sink), capacity)
        self.reset()

    def make_state(self, n_slots):
        return ReconstructionScores(n_slots, self.n_kv_heads)

    def reset(self):
        self.head_budgets: np.ndarray | None = None  # (n_layers, n_kv_heads) entries kept, once compressed
        self.context_length = 0

    @property
    def compressed(self) -> bool:
        return self.head_budgets is not None

    def context_of(self, n_prompt: int) -> int:
        """The tokens prefilled before the compression: the prompt's, or the first `context` of them."""
        return min(self.context or n_prompt, n_prompt)

    def protected(self, pages):
        return pages.occupied() & (pages.positions < self.n_sink)

    def values(self, pages: LayerView) -> np.ndarray:
        """(n_kv_heads, n_slots): what each entry is worth keeping — its KVzip score (1 for sinks), or for a
        token written after compression DECODED + its position."""
        stats = pages.stats
        assert isinstance(stats, ReconstructionScores)  # the state kvzip's make_state gives every layer
        scores = np.where(pages.positions < self.n_sink, 1.0, stats.scores.T)
        decoded = self.compressed & (pages.positions >= self.context_length)
        return np.where(decoded, DECODED + pages.positions, scores)

    def score(self, pages):
        """A token's best value over the heads that keep it (what a whole-token eviction goes by)."""
        return np.where(pages.kept(), self.values(pages), -np.inf).max(axis=0)

    def compress(self, views: list[LayerView]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The entries to drop, per layer (heads, slots, scores): all but the budget x layers x KV heads best
        entries over every layer (ties: the older token goes, then the lower KV head and layer). Fixes
        each (layer, KV head)'s budget and the context's length."""
        values = np.stack([self.values(view) for view in views])  # (layers, n_kv, slots)
        kept = np.stack([view.kept() for view in views])
        layers, heads, slots = np.nonzero(kept)
        positions = np.stack([view.positions for view in views])[layers, slots]
        order = np.lexsort((layers, heads, positions, values[layers, heads, slots]))
        dropped = order[: max(0, len(order) - bound(self.budget, "budget") * len(views) * self.n_kv_heads)]
        kept[layers[dropped], heads[dropped], slots[dropped]] = False
        self.head_budgets = kept.sum(axis=2)
        self.context_length = int(positions.max()) + 1 if len(positions) else 0
        per_layer = [dropped[layers[dropped] == layer] for layer in range(len(views))]
        return [(heads[gone], slots[gone], values[layer, heads[gone], slots[gone]])
                for layer, gone in enumerate(per_layer)]

    def head_room(self, pages):
        if not self.compressed:  # a prefill chunk stops at the context (the pass runs after that step)
            return (self.context or self.capacity) - int(pages.occupied().sum())
        assert self.head_budgets is not None  # set by compress
        return max(0, int((self.head_budgets[pages.layer] - pages.kept().sum(axis=1)).min()))

    def choose_head_victims(self, pages):
        """After compression: each KV head at its budget drops its lowest entries (not sinks) to make room."""
        if not self.compressed:
            return super().choose_head_victims(pages)
        kept, values = pages.kept(), self.values(pages)
        droppable = kept & ~self.protected(pages)[None, :]
        assert self.head_budgets is not None  # set by compress
        heads: list[int] = []
        slots: list[int] = []
        for head, (budget, row) in enumerate(zip(self.head_budgets[pages.layer], droppable, strict=True)):
            over = int(kept[head].sum()) + 1 - int(budget)
            candidates = np.flatnonzero(row)
            gone = candidates[np.lexsort((pages.positions[candidates], values[head, candidates]))[: max(0, over)]]
            heads += [head] * len(gone)
            slots += gone.tolist()
        head_ids, slot_ids = np.array(heads, dtype=np.int64), np.array(slots, dtype=np.int64)
        return head_ids, slot_ids, values[head_ids, slot_ids]

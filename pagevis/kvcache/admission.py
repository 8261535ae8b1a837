"""What the scheduler asks the cache before it schedules a sequence's tokens: its room before the policy evicts,
the pages writing n more tokens may take from the pool, whether the pool has them, and how long a prefill chunk
may be. The cache manager (kv_cache_manager.py) answers them from its layers' managers (layers.py)."""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.config import CacheConfig
from pagevis.kvcache.layers import LayerManager
from pagevis.kvcache.sequence import SequenceCache
from pagevis.kvcache.store import PageStore

# With a disk tier, prefill chunks are cut so that their scores over a batch of frames, and their weights
# over every slot when the policy learns from attention, stay under this many float32 values (32 MB).
MAX_CHUNK_WEIGHTS = 8 << 20
# With a disk tier the free slots no longer bound a prefill chunk; this does, so that a long prompt's
# transient arrays (and the process's memory after them) do not grow with the context.
MAX_TIERED_CHUNK = 1024


class Admission:
    """The scheduler's questions, answered by the cache manager (a part of it: it reads the manager's
    sequences, layers, stores and config)."""

    config: CacheConfig
    page_size: int
    select_pages: int | None
    sequences: dict[int, SequenceCache]
    layers: list[LayerManager]
    stores: list[PageStore]

    def n_free(self) -> int:
        """Pages free in every layer (cached free pages included)."""
        return min(store.pages.n_free() for store in self.stores)

    fewest_free = n_free  # free pages of the layer that has the fewest

    def free_slots(self, seq_id: int) -> int:
        """Tokens every layer of the sequence can take before its policy must evict: its budget (a policy
        may give a layer less: pyramidkv), and the pool."""
        return min(layer_free_slots(layer, self.sequences[seq_id]) for layer in self.layers)

    def layer_budget(self, seq_id: int, layer: int) -> int:
        """Tokens the layer may hold before the sequence's policy evicts there: its policy's budget, except on a
        local layer whose window is the smaller bound (there the window slides and the policy never runs)."""
        return self.layers[layer].budget(self.sequences[seq_id])

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still add before its policy must evict (its budget, not the pool; for a
        per-head policy also before it must drop an entry, so that a prefill chunk never evicts mid-chunk on
        statistics that have not seen the chunk; likewise for a policy that prunes at any fill)."""
        seq = self.sequences[seq_id]
        rooms = [layer.budget(seq) - seq.resident[layer.layer] for layer in self.layers]
        if seq.policy.per_head:
            rooms += [seq.policy.head_room(layer.view(seq)) for layer in self.layers]
        if seq.policy.prunes:
            rooms += [seq.policy.prune_room(layer.view(seq)) for layer in self.layers]
        return min(rooms)

    def is_full(self, seq_id: int) -> bool:
        """Whether the sequence takes no more tokens: its room is used up and its policy never evicts ('none')."""
        return self.room(seq_id) <= 0 and not self.sequences[seq_id].policy.evicts

    def hit_limit(self, seq_id: int, longest: int, n_tokens: int) -> int:
        """How many of its n_tokens a sequence that may grow to `longest` tokens may take from the prefix cache
        and still decode what it would alone: all if it never reaches its budget (its smallest layer's); else
        what it holds before its first eviction, its budget — none if its policy learns from attention, which
        cached pages never got from it."""
        seq = self.sequences[seq_id]
        budget = min(layer.budget(seq) for layer in self.layers)
        if longest <= budget:
            return n_tokens
        return 0 if seq.policy.uses_attention else budget

    def can_append(self, seq_id: int, n: int) -> bool:
        """Whether n more tokens fit, by eviction if the policy evicts. Check before a step so that a
        full cache fails before any layer has changed."""
        return self.sequences[seq_id].policy.evicts or self.free_slots(seq_id) >= n

    def pages_needed(self, seq_id: int, n_tokens: int) -> list[int]:
        """Per layer, an upper bound on the pages writing n_tokens more will take from the pool."""
        return [layer_pages_needed(layer, self.sequences[seq_id], n_tokens) for layer in self.layers]

    def pages_bound(self, seq_id: int, n_tokens: int) -> int:
        """A cheap upper bound on every layer's `pages_needed`: each of its copy-on-write terms copies at most
        every page of the table once."""
        longest = max(len(table) for table in self.sequences[seq_id].block_tables)
        return 3 * longest + -(-n_tokens // self.page_size)

    def fits(self, needs: list[int]) -> bool:
        """Whether the pool has the pages `needs` (per layer) asks for."""
        return all(need <= store.pages.n_free() for need, store in zip(needs, self.stores, strict=True))

    def max_chunk(self, seq_id: int) -> int | None:
        """The most tokens one prefill step of the sequence may feed (None: no limit beyond its room). With
        a disk tier, a chunk's scores over one batch of frames (and for a policy that learns from
        attention, its weights over every slot) stay under MAX_CHUNK_WEIGHTS floats. With quest, a chunk
        stops where the sequence outgrows select_pages pages: from there on every query is fed alone and
        reads its own selection."""
        limits = []
        cfg, seq = self.config, self.sequences[seq_id]
        if cfg.tiered:
            frames = max(cfg.home_frames, cfg.max_pages - cfg.home_frames)
            limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * frames * cfg.page_size))
            limits.append(MAX_TIERED_CHUNK)
            if seq.policy.uses_attention:
                limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * cfg.capacity))
        if self.select_pages is not None:
            limits.append(self.select_pages * cfg.page_size - max(seq.resident))
        return max(1, min(limits)) if limits else None


    def ensure_room(self, seq_id: int, n: int) -> None:
        """Raise before anything changes if n tokens cannot go in: CacheFullError from policy 'none',
        SwapSpaceError when the disk tier has no space for the pages they may need."""
        if not self.can_append(seq_id, n):
            self.sequences[seq_id].policy.choose_victims(self.view(seq_id, 0))  # raises CacheFullError
        for store, need in zip(self.stores, self.pages_needed(seq_id, n), strict=True):
            store.reserve(need)


def layer_free_slots(layer: LayerManager, seq: SequenceCache) -> int:
    """Tokens the layer takes before the sequence's policy must evict: its budget, and the pool."""
    index = layer.layer
    return min(len(seq.holes[index]) + layer.store.pages.n_free() * layer.page_size,
               layer.budget(seq) - seq.resident[index])


def layer_pages_needed(layer: LayerManager, seq: SequenceCache, n_tokens: int) -> int:
    """An upper bound on the pages writing n_tokens more takes from the pool (new pages, and the shared
    pages that writing, evicting, quantizing, pruning, re-rotating or merging would copy)."""
    store, ps, table, policy = layer.store, layer.page_size, seq.block_tables[layer.layer], seq.policy
    fill = store.fill[table] if table else np.zeros(0, dtype=np.int64)
    shared = store.pages.ref_counts[table] > 1 if table else np.zeros(0, dtype=bool)
    room = len(seq.holes[layer.layer])
    n_evict = max(0, seq.resident[layer.layer] + n_tokens - layer.budget(seq)) if policy.evicts else 0
    if n_evict:  # a policy evicting N at once (periodic compression) evicts N each time the budget is reached
        n_evict += policy.evicted_at_once() - 1
    need = int((shared & (fill < ps)).sum()) + min(n_evict, int(shared.sum()))
    if store.kivi:  # quantizing a key group copies the shared pages it touches
        need += min(int(shared.sum()), -(-store.layout.group // ps) + 1)
    if (policy.prunes or (n_evict and policy.rewrites_survivors())
            or (seq.channels is not None and not seq.channels.chosen)):
        need += int(shared.sum())  # pruned tokens or key channels, rotated keys, merged values: any shared page
    return need + -(-max(0, n_tokens - room - n_evict) // ps)

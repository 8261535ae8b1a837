"""What the scheduler asks the cache before it schedules a sequence's tokens, in four questions (vLLM's
get_computed_blocks, allocate_slots; nano-vllm's can_allocate, may_append):

- `admit`: a new sequence, pointed at the cached pages of its prompt's longest prefix it may reuse;
- `chunk_limit`: the most tokens its next step may feed (its room before the policy evicts, the tiers' limits);
- `is_full`: whether it takes no more tokens (its room is used up and its policy never evicts);
- `allocate`: whether the pool holds the pages a step's chunks may take — a Reservation, or None.

The cache manager (kv_cache_manager.py) answers them from its layers' managers (layer_managers.py)."""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from pagevis.kvcache.layer_managers import LayerManager
from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.sequence import SequenceCache

# With a disk tier, prefill chunks are cut so that their scores over a batch of frames, and their weights
# over every slot when the policy learns from attention, stay under this many float32 values (32 MB).
MAX_CHUNK_WEIGHTS = 8 << 20
# With a disk tier the free slots no longer bound a prefill chunk; this does, so that a long prompt's
# transient arrays (and the process's memory after them) do not grow with the context.
MAX_TIERED_CHUNK = 1024


@dataclass(frozen=True)
class Reservation:
    """The pages a step's chunks ((seq_id, n_tokens), ...) may take from the pool: per layer, counted exactly
    (`pages`), or None while a cheap bound (`bound`: pages, the same for every layer) showed they fit."""

    chunks: tuple[tuple[int, int], ...]
    pages: np.ndarray | None
    bound: int = 0


class Admission:
    """The scheduler's questions, answered from the cache manager's sequences, layers and pools (the manager
    holds one: `KVCacheManager.admission`)."""

    def __init__(self, cache):
        self.cache = cache  # the KVCacheManager that holds it (not imported here: it imports this module)
        self._kivi: bool | None = None  # whether a layer's store quantizes keys by groups (its stores, once made)
        # (every step asks each sequence's room and free slots over every layer: `token_room` reads the tables
        # of the layers whose budget is the policy's own capacity without asking each layer for it)
        layers = cache.layers
        self._tables = [layer.tables for layer in layers]
        self._plain = [layer.tables for layer in layers if type(layer).budget is LayerManager.budget]
        self._others = [layer for layer in layers if type(layer).budget is not LayerManager.budget]
        self._pools = [store.pages for store in cache.stores]

    def admit(self, seq_id: int, tokens, policy=None, longest: int | None = None, cache_salt: str | None = None
              ) -> int:
        """A new sequence for `tokens` (evicting by `policy`, default the settings'), pointed at the cached pages
        of their longest cached prefix it may reuse if it will grow to `longest` tokens (`hit_limit`; None: no
        reuse, the caller needs every token's logits); `cache_salt`: the root its pages hash from
        (`match_prefix`). Returns the tokens reused."""
        self.cache.add_sequence(seq_id, policy)
        reuse = 0 if longest is None else self.hit_limit(seq_id, longest, len(tokens))
        return self.cache.match_prefix(seq_id, tokens[: reuse + 1], cache_salt)

    def chunk_limit(self, seq_id: int) -> int:
        """The most tokens the sequence's next step may feed: its room before its policy evicts, and the cache's
        own prefill limit (`max_chunk`: a disk tier, quest). 0 or less: it must evict to go on (one at a time)."""
        limit = self.max_chunk(seq_id)
        return self.room(seq_id) if limit is None else min(self.room(seq_id), limit)

    def allocate(self, chunks, held: Reservation | None = None) -> Reservation | None:
        """Whether the pool holds the pages writing these (seq_id, n_tokens) chunks may take, on top of the ones
        `held` counts: their Reservation (with held's chunks), or None (vLLM's allocate_slots; pages are taken
        as the tokens are written). A cheap bound (`pages_bound`, ~5 us a sequence) answers first while the
        chunks held were bounded too; the exact count (`pages_needed`, per layer and sequence: ~0.35 ms a
        sequence of SmolLM2's 30 layers) only when the bounds do not fit, so both say the same but for time."""
        chunks = tuple(chunks)
        earlier = held.chunks if held is not None else ()
        if held is None or held.pages is None:
            bound = (held.bound if held is not None else 0) + sum(self.pages_bound(s, n) for s, n in chunks)
            if bound <= self.n_free():
                return Reservation(earlier + chunks, None, bound)
        base = held.pages if held is not None and held.pages is not None else self._needs(earlier)
        total = base + self._needs(chunks)
        return Reservation(earlier + chunks, total) if self.fits(total.tolist()) else None

    def _needs(self, chunks) -> np.ndarray:
        total = np.zeros(len(self.cache.stores), dtype=np.int64)
        for seq_id, n_tokens in chunks:
            total += self.pages_needed(seq_id, n_tokens)
        return total

    def n_free(self) -> int:
        """Pages free in the layer that has the fewest (cached free pages included)."""
        return min(store.pages.n_free() for store in self.cache.stores)

    def free_slots(self, seq_id: int) -> int:
        """Tokens every layer of the sequence can take before its policy must evict: its budget (a policy
        may give a layer less: pyramidkv), and the pool: the least over the layers of its budget less its
        resident tokens (`token_room`) and of its holes and its pool's free slots. The pool's term is counted
        per layer only when its floor, the fewest free pages' slots, is below the budget's term: else the budget's
        term is the least."""
        seq = self.cache.sequences[seq_id]
        room = self.token_room(seq)
        if room <= min([pool.n_free() for pool in self._pools]) * self.cache.page_size:
            return room
        return min(room, min(tables[seq_id].n_holes() + pool.n_free() * self.cache.page_size
                             for tables, pool in zip(self._tables, self._pools, strict=True)))

    def token_room(self, seq: SequenceCache) -> int:
        """The least over the layers of the sequence's budget less its resident tokens. A policy whose
        budget is the same in every layer (`EvictionPolicy.layer_capacity` not overridden) is not asked per
        layer where the layer's budget is the policy's (`LayerManager.budget`: a global layer)."""
        seq_id, policy = seq.seq_id, seq.policy
        if type(policy).layer_capacity is not EvictionPolicy.layer_capacity or not self._plain:
            return min(layer.budget(seq) - layer.tables[seq_id].resident for layer in self.cache.layers)
        room = policy.capacity - max([tables[seq_id].resident for tables in self._plain])
        for layer in self._others:
            room = min(room, layer.budget(seq) - layer.tables[seq_id].resident)
        return room

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still add before its policy must evict (its budget, not the pool; for a
        per-head policy also before it must drop an entry, so that a prefill chunk never evicts mid-chunk on
        statistics that have not seen the chunk; likewise for a policy that prunes at any fill)."""
        seq = self.cache.sequences[seq_id]
        rooms = [self.token_room(seq)]
        if seq.policy.per_head:
            rooms += [seq.policy.head_room(layer.view(seq)) for layer in self.cache.layers]
        if seq.policy.prunes:
            rooms += [seq.policy.prune_room(layer.view(seq)) for layer in self.cache.layers]
        return min(rooms)

    def is_full(self, seq_id: int) -> bool:
        """Whether the sequence takes no more tokens: its room is used up and its policy never evicts ('none')."""
        return not self.cache.sequences[seq_id].policy.evicts and self.room(seq_id) <= 0

    def hit_limit(self, seq_id: int, longest: int, n_tokens: int) -> int:
        """How many of its n_tokens a sequence that may grow to `longest` tokens may take from the prefix cache
        and still decode what it would alone: all if it never reaches its budget (its smallest layer's); else
        what it holds before its first eviction, its budget — none if its policy learns from attention, which
        cached pages never got from it."""
        seq = self.cache.sequences[seq_id]
        budget = min(layer.budget(seq) for layer in self.cache.layers)
        if longest <= budget:
            return n_tokens
        return 0 if seq.policy.uses_attention else budget

    def can_append(self, seq_id: int, n: int) -> bool:
        """Whether n more tokens fit, by eviction if the policy evicts. Check before a step so that a
        full cache fails before any layer has changed."""
        return self.cache.sequences[seq_id].policy.evicts or self.free_slots(seq_id) >= n

    def pages_needed(self, seq_id: int, n_tokens: int) -> list[int]:
        """Per layer, an upper bound on the pages writing n_tokens more will take from the pool."""
        return [layer_pages_needed(layer, self.cache.sequences[seq_id], n_tokens) for layer in self.cache.layers]

    def pages_bound(self, seq_id: int, n_tokens: int) -> int:
        """A cheap upper bound on every layer's `pages_needed`: the new pages of n_tokens (holes only lower
        them), and each copy-on-write term of `layer_pages_needed` that can apply to this sequence (`copy_terms`)
        copies at most every page of its table once; none when the cache holds one sequence (no page is shared
        then)."""
        new_pages = -(-n_tokens // self.cache.page_size)
        if len(self.cache.sequences) == 1:
            return new_pages
        seq = self.cache.sequences[seq_id]
        return self.copy_terms(seq) * max([len(tables[seq_id].pages) for tables in self._tables]) + new_pages

    def copy_terms(self, seq: SequenceCache) -> int:
        """How many of `layer_pages_needed`'s terms that count shared pages can be non-zero for this sequence:
        writing into a shared page that is not full (always), evicting from shared pages (a policy that
        evicts), quantizing a key group (a kivi store), and rewriting any shared page (a policy that prunes,
        merges or re-rotates, key channels not chosen yet)."""
        policy = seq.policy
        if self._kivi is None:
            self._kivi = any(store.kivi for store in self.cache.stores)
        rewrites = (policy.prunes or (policy.evicts and policy.rewrites_survivors())
                    or (seq.channels is not None and not seq.channels.chosen))
        return 1 + int(policy.evicts) + int(self._kivi) + int(rewrites)

    def fits(self, needs: list[int]) -> bool:
        """Whether the pool has the pages `needs` (per layer) asks for."""
        return all(need <= store.pages.n_free() for need, store in zip(needs, self.cache.stores, strict=True))

    def max_chunk(self, seq_id: int) -> int | None:
        """The most tokens one prefill step of the sequence may feed (None: no limit beyond its room). With
        a disk tier, a chunk's scores over one batch of frames (and for a policy that learns from
        attention, its weights over every slot) stay under MAX_CHUNK_WEIGHTS floats. With quest, a chunk
        stops where the sequence outgrows select_pages pages: from there on every query is fed alone and
        reads its own selection."""
        limits = []
        cfg, seq = self.cache.config, self.cache.sequences[seq_id]
        if cfg.tiered:
            frames = max(cfg.home_frames, cfg.max_pages - cfg.home_frames)
            limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * frames * cfg.page_size))
            limits.append(MAX_TIERED_CHUNK)
            if seq.policy.uses_attention:
                limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * cfg.capacity))
        if self.cache.select_pages is not None:
            limits.append(self.cache.select_pages * cfg.page_size - max(layer.table(seq).resident
                                                                         for layer in self.cache.layers))
        return max(1, min(limits)) if limits else None


    def ensure_rooms(self, chunks) -> None:
        """`ensure_room` of each (seq_id, n_tokens) of a step in turn. Without a disk tier nothing changes the
        pool between them, so its floor (the fewest free pages' slots) is counted once, and a sequence whose
        policy never evicts and whose `token_room` and that floor both hold its tokens is not asked per layer
        (`free_slots` is then at least its tokens: `can_append` holds)."""
        floor = None
        for seq_id, n in chunks:
            seq = self.cache.sequences[seq_id]
            if not self.cache.config.tiered and not seq.policy.evicts:
                if floor is None:
                    floor = self.n_free() * self.cache.page_size
                if n <= floor and self.token_room(seq) >= n:
                    continue
            self.ensure_room(seq_id, n)

    def ensure_room(self, seq_id: int, n: int) -> None:
        """Raise before anything changes if n tokens cannot go in: CacheFullError from policy 'none',
        SwapSpaceError when the disk tier has no space for the pages they may need."""
        if not self.can_append(seq_id, n):
            self.cache.sequences[seq_id].policy.choose_victims(self.cache.view(seq_id, 0))  # raises CacheFullError
        if self.cache.config.tiered:  # (a RAM-only store reserves nothing)
            for store, need in zip(self.cache.stores, self.pages_needed(seq_id, n), strict=True):
                store.reserve(need)


def layer_pages_needed(layer: LayerManager, seq: SequenceCache, n_tokens: int) -> int:
    """An upper bound on the pages writing n_tokens more takes from the pool (new pages, and the shared
    pages that writing, evicting, quantizing, pruning, re-rotating or merging would copy)."""
    store, ps, own, policy = layer.store, layer.page_size, layer.table(seq), seq.policy
    table = own.pages
    fill = store.fill[table] if table else np.zeros(0, dtype=np.int64)
    shared = store.pages.ref_counts[table] > 1 if table else np.zeros(0, dtype=bool)
    room = own.n_holes()
    n_evict = max(0, own.resident + n_tokens - layer.budget(seq)) if policy.evicts else 0
    if n_evict:  # a policy evicting N at once (periodic compression) evicts N each time the budget is reached
        n_evict += policy.evicted_at_once() - 1
    need = int((shared & (fill < ps)).sum()) + min(n_evict, int(shared.sum()))
    if store.kivi and store.layout is not None:  # quantizing a key group copies the shared pages it touches
        need += min(int(shared.sum()), -(-store.layout.group // ps) + 1)
    if (policy.prunes or (n_evict and policy.rewrites_survivors())
            or (seq.channels is not None and not seq.channels.chosen)):
        need += int(shared.sum())  # pruned tokens or key channels, rotated keys, merged values: any shared page
    return need + -(-max(0, n_tokens - room - n_evict) // ps)

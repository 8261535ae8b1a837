"""Many sequences, one pool: shared pages with reference counts, copy-on-write, fork, prefix caching.

Every layer has one PageStore (the K/V frames and the token position of each slot) and one BlockManager
(reference counts, the LRU free queue, prefix hashes). Each sequence owns block tables per layer, its own
eviction policy and its own policy statistics; its token budget is the cache settings' capacity, while
the pool's frames are shared by all sequences. A page two sequences point at is never written: the
writer copies it first (copy-on-write), whether it appends into a shared partial page or its policy
evicts a token from a shared page, so no sequence ever changes what another one reads.

Attention for a sequence gathers its own pages through its block table (the single-sequence cache reads
its pool's prefix without a gather; with many owners the pool prefix is not one sequence's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import check_int
from .attention import AttentionResult, attend
from .block_manager import BlockManager
from .config import MAX_PAGES, CacheConfig
from .errors import CacheFullError, ConfigError
from .policies import EvictionPolicy, make_policy
from .policy_state import LayerView, PolicyState
from .prefix_cache import PrefixCacheStats, page_hash, prefix_hashes, ROOT_HASH
from .sequence import Sequence
from .store import PageStore


class PoolEvent(NamedTuple):
    """What happened to the shared pool. kind: allocate, share (a prefix hit or fork pointed one more
    table entry at a page), cow (copy-on-write: `page` was copied to `detail`), evict, release, fork, free,
    preempt. page/layer are -1 for sequence-level events."""

    kind: str
    step: int
    seq: int
    layer: int = -1
    page: int = -1
    detail: int = -1


@dataclass
class PoolSequence:
    seq_id: int
    table: Sequence
    policy: EvictionPolicy
    states: list[PolicyState]
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are written, in position order
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full logical page, while hashable
    hashable: bool = True  # False once the sequence evicted: its pages no longer hold whole prefixes


class SharedKVPool:
    """K/V pages for many sequences. `config` gives the head layout, the page size and each sequence's
    budget (max_pages * page_size tokens) and policy; `pool_pages` is the number of frames per layer."""

    def __init__(self, config: CacheConfig, pool_pages: int, prefix_caching: bool = True):
        check_int("pool_pages", pool_pages, 1, MAX_PAGES)
        if config.disk_pages or config.select != "all":
            field, value = ("disk_pages", config.disk_pages) if config.disk_pages else ("select", config.select)
            raise ConfigError(field, value, "0 / 'all' with many sequences: the shared pool keeps every page in "
                                            "RAM and reads all of a sequence's pages")
        self.config = config
        self.pool_pages = pool_pages
        self.page_size = config.page_size
        storage = CacheConfig(**{**config.cache_settings(), "max_pages": pool_pages, "policy": "none",
                                 "policy_params": {}, "disk_pages": 0, "select": "all"}, n_layers=config.n_layers, n_heads=config.n_heads,
                              n_kv_heads=config.n_kv_heads, head_dim=config.head_dim)
        self.stores = [PageStore(storage, layer) for layer in range(config.n_layers)]
        self.blocks = [BlockManager(pool_pages) for _ in range(config.n_layers)]
        self.prefix_caching = prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.sequences: dict[int, PoolSequence] = {}
        self.step = 0
        self.events: list[PoolEvent] = []
        self.cow_total = 0

    # --- questions -------------------------------------------------------------------------------
    def block_table(self, seq_id: int, layer: int = 0) -> list[int]:
        return self.sequences[seq_id].table.block_tables[layer]

    def resident(self, seq_id: int, layer: int) -> int:
        return int(self.stores[layer].fill[self.block_table(seq_id, layer)].sum())

    def n_free(self) -> int:
        """Frames free in every layer (cached free frames included)."""
        return min(blocks.n_free() for blocks in self.blocks)

    def pages_used(self, layer: int = 0) -> int:
        return self.blocks[layer].n_used()

    def pages_unshared(self, layer: int = 0) -> int:
        """Pages the live sequences would hold if none were shared (the sum of their block tables)."""
        return sum(len(seq.table.block_tables[layer]) for seq in self.sequences.values())

    def take_events(self) -> list[PoolEvent]:
        events, self.events = self.events, []
        return events

    def pages_needed(self, seq_id: int, n_tokens: int) -> list[int]:
        """Per layer, an upper bound on the frames writing n_tokens more will take from the pool."""
        seq, ps = self.sequences[seq_id], self.page_size
        needs = []
        for layer, (store, blocks) in enumerate(zip(self.stores, self.blocks)):
            table = seq.table.block_tables[layer]
            fill = store.fill[table] if table else np.zeros(0, dtype=np.int64)
            shared = blocks.ref_counts[table] > 1 if table else np.zeros(0, dtype=bool)
            room = int((ps - fill).sum())
            n_evict = max(0, int(fill.sum()) + n_tokens - self.config.capacity) if seq.policy.evicts else 0
            need = int((shared & (fill < ps)).sum()) + min(n_evict, int(shared.sum()))
            need += -(-max(0, n_tokens - room - n_evict) // ps)
            needs.append(need)
        return needs

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still add before its policy must evict (its budget, not the pool)."""
        policy = self.sequences[seq_id].policy
        return min(policy.layer_capacity(layer) - self.resident(seq_id, layer) for layer in range(len(self.stores)))

    # --- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> PoolSequence:
        if seq_id in self.sequences:
            raise ConfigError("seq_id", seq_id, "an id no live sequence has")
        policy = make_policy(self.config)
        n_slots = self.pool_pages * self.page_size
        seq = PoolSequence(seq_id, Sequence(self.config.n_layers, seq_id), policy,
                           [policy.make_state(n_slots) for _ in self.stores])
        self.sequences[seq_id] = seq
        return seq

    def match_prefix(self, seq_id: int, token_ids) -> int:
        """Point an empty sequence at the cached pages of token_ids' longest cached full-page prefix
        (leaving at least the last token to compute). Returns the number of tokens reused. The caller
        counts the lookup in `prefix_stats` once the sequence is admitted."""
        seq = self.sequences[seq_id]
        if any(seq.table.block_tables) or not self.prefix_caching:
            return 0
        hashes = prefix_hashes(token_ids[: len(token_ids) - 1], self.page_size)
        hit = []
        for h in hashes:
            frames = [blocks.lookup(h) for blocks in self.blocks]
            if any(frame is None for frame in frames):
                break
            hit.append((h, frames))
        for h, frames in hit:
            for layer, frame in enumerate(frames):
                self.blocks[layer].share(frame)
                seq.table.block_tables[layer].append(frame)
            seq.hashes.append(h)
            self._event("share", seq_id, 0, frames[0])
        n_tokens = len(hit) * self.page_size
        seq.token_ids = list(token_ids[:n_tokens])
        return n_tokens

    def fork(self, parent_id: int, child_id: int, n_tokens: int | None = None) -> PoolSequence:
        """A new sequence that reads the parent's first n_tokens tokens (all by default) without copying:
        it shares every page whose tokens all come before n_tokens; a page holding later tokens too is
        copied with those masked out. The child gets a copy of the parent's policy and statistics."""
        parent = self.sequences[parent_id]
        n = len(parent.token_ids) if n_tokens is None else check_int("n_tokens", n_tokens, 0, len(parent.token_ids))
        child = self.add_sequence(child_id)
        child.policy = copy.deepcopy(parent.policy)
        child.states = [copy.deepcopy(state) for state in parent.states]
        child.token_ids = parent.token_ids[:n]
        child.hashable = parent.hashable
        child.hashes = parent.hashes[: n // self.page_size]
        ps = self.page_size
        for layer, (store, blocks) in enumerate(zip(self.stores, self.blocks)):
            for page in parent.table.block_tables[layer]:
                positions = store.positions[page * ps: (page + 1) * ps]
                keep = (positions >= 0) & (positions < n)
                if not keep.any():
                    continue
                if keep.sum() == store.fill[page]:
                    blocks.share(page)
                    child.table.block_tables[layer].append(page)
                    self._event("share", child_id, layer, page)
                else:
                    copied = self._copy_page(child, layer, page, keep)
                    self._event("cow", child_id, layer, page, copied)
        self._event("fork", child_id, detail=parent_id)
        return child

    def free(self, seq_id: int, kind: str | None = "free") -> None:
        """Drop the sequence; its pages go back to the free queue when no other sequence uses them
        (last pages first, so a cached prefix outlives its tail). kind None: no event (an admission
        that did not fit after all)."""
        seq = self.sequences.pop(seq_id)
        for blocks, table in zip(self.blocks, seq.table.block_tables):
            for page in reversed(table):
                blocks.release(page)
            table.clear()
        if kind is not None:
            self._event(kind, seq_id)

    # --- writing -----------------------------------------------------------------------------------
    def extend(self, seq_id: int, token_ids) -> None:
        """The token ids whose K/V the coming `append` calls write (prefix hashes need them)."""
        self.sequences[seq_id].token_ids.extend(int(t) for t in token_ids)

    def append(self, seq_id: int, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Write n tokens' K/V into the sequence's own pages, evicting (its policy) at its budget and
        copying any shared page before changing it."""
        seq, store = self.sequences[seq_id], self.stores[layer]
        state = seq.states[layer]
        for i, position in enumerate(positions):
            if self.resident(seq_id, layer) >= seq.policy.layer_capacity(layer):
                if not seq.policy.evicts:
                    raise CacheFullError(f"sequence {seq_id} holds {self.config.capacity} tokens and policy "
                                         f"'none' does not evict")
                self._evict(seq, layer)
            page = self._writable_page(seq, layer)
            start = page * self.page_size
            slot = int(np.flatnonzero(store.positions[start: start + self.page_size] < 0)[0])
            store.write(start + slot, k[i], v[i], int(position))
            store.holes.discard(start + slot)
            state.clear(start + slot)

    def commit(self, seq_id: int) -> None:
        """After a step: register the sequence's newly full pages under their prefix hashes."""
        seq = self.sequences[seq_id]
        if not (seq.hashable and self.prefix_caching):
            return
        ps = self.page_size
        while (len(seq.hashes) + 1) * ps <= len(seq.token_ids):
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            h = page_hash(parent, seq.token_ids[i * ps: (i + 1) * ps])
            seq.hashes.append(h)
            for blocks, table in zip(self.blocks, seq.table.block_tables):
                blocks.register(table[i], h)

    def _writable_page(self, seq: PoolSequence, layer: int) -> int:
        """The sequence's first page with an empty slot, copied first if shared; a new page if none."""
        store, blocks = self.stores[layer], self.blocks[layer]
        table = seq.table.block_tables[layer]
        for page in table:
            if store.fill[page] < self.page_size:
                if blocks.is_shared(page):
                    return self._copy_on_write(seq, layer, page)
                blocks.forget(page)
                return page
        if not blocks.n_free():
            raise CacheFullError(f"the pool's {self.pool_pages} pages of layer {layer} are all in use "
                                 f"(sequence {seq.seq_id} needs one more)")
        page = self._allocate(layer)
        table.append(page)
        self._event("allocate", seq.seq_id, layer, page)
        return page

    def _allocate(self, layer: int) -> int:
        page = self.blocks[layer].allocate()
        store, ps = self.stores[layer], self.page_size
        store.positions[page * ps: (page + 1) * ps] = -1
        store.bias[page * ps: (page + 1) * ps] = -np.inf
        store.fill[page] = 0
        return page

    def _copy_on_write(self, seq: PoolSequence, layer: int, page: int) -> int:
        ps = self.page_size
        keep = self.stores[layer].positions[page * ps: (page + 1) * ps] >= 0
        copied = self._copy_page(seq, layer, page, keep, replace=True)
        self.cow_total += 1
        self._event("cow", seq.seq_id, layer, page, copied)
        return copied

    def _copy_page(self, seq: PoolSequence, layer: int, page: int, keep: np.ndarray, replace: bool = False) -> int:
        """Copy the `keep` slots of page into a new page of seq (replacing page in its table, or appended)."""
        store, blocks, ps = self.stores[layer], self.blocks[layer], self.page_size
        if not blocks.n_free():
            raise CacheFullError(f"the pool's {self.pool_pages} pages of layer {layer} are all in use "
                                 f"(sequence {seq.seq_id} must copy page {page} before writing to it)")
        new = self._allocate(layer)
        store.k[:, new] = store.k[:, page]
        store.v[:, new] = store.v[:, page]
        src, dst = slice(page * ps, (page + 1) * ps), slice(new * ps, (new + 1) * ps)
        store.positions[dst] = np.where(keep, store.positions[src], -1)
        store.bias[dst] = np.where(keep, store.bias[src], -np.inf)
        store.fill[new] = int(keep.sum())
        for array in seq.states[layer].arrays.values():
            array[dst] = np.where(keep, array[src], 0)
        table = seq.table.block_tables[layer]
        if replace:
            table[table.index(page)] = new
            blocks.release(page)
        else:
            table.append(new)
        return new

    def _evict(self, seq: PoolSequence, layer: int) -> None:
        store, blocks, ps = self.stores[layer], self.blocks[layer], self.page_size
        victims, _ = seq.policy.choose_victims(self.view(seq.seq_id, layer))
        seq.hashable = False
        copies: dict[int, int] = {}  # shared page -> this sequence's copy (a policy may take several slots)
        for flat in victims.tolist():
            page, slot = divmod(flat, ps)
            page = copies.get(page, page)
            if blocks.is_shared(page):
                copies[page] = page = self._copy_on_write(seq, layer, page)
            blocks.forget(page)
            position = store.remove(page * ps + slot)
            store.holes.discard(page * ps + slot)
            self._event("evict", seq.seq_id, layer, page, position)
            if store.fill[page] == 0:
                seq.table.block_tables[layer].remove(page)
                blocks.release(page)
                self._event("release", seq.seq_id, layer, page)

    def view(self, seq_id: int, layer: int) -> LayerView:
        """What the sequence's policy reads: positions of its own slots only (-1 elsewhere)."""
        seq, store = self.sequences[seq_id], self.stores[layer]
        table = seq.table.block_tables[layer]
        positions = np.full(store.n_slots, -1, dtype=np.int64)
        flat = self._flat_slots(table)
        positions[flat] = store.positions[flat]
        return LayerView(layer, self.page_size, positions, table, seq.states[layer])

    def _flat_slots(self, table: list[int]) -> np.ndarray:
        pages = np.asarray(table, dtype=np.int64)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()

    def _event(self, kind: str, seq: int, layer: int = -1, page: int = -1, detail: int = -1) -> None:
        self.events.append(PoolEvent(kind, self.step, seq, layer, page, detail))

    # --- attention -------------------------------------------------------------------------------
    def attend(self, seq_id: int, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention of the sequence's n queries over its own resident tokens (gathered through its
        block table). Weights come back over its flat slots in block-table order."""
        seq, store = self.sequences[seq_id], self.stores[layer]
        table = seq.table.block_tables[layer]
        n_kv, _, ps, head_dim = store.k.shape
        keys = store.k[:, table].reshape(n_kv, len(table) * ps, head_dim)
        values = store.v[:, table].reshape(n_kv, len(table) * ps, head_dim)
        flat = self._flat_slots(table)
        bias = store.bias[flat]
        result = attend(q, keys, values, None if not bias.any() else bias, store.positions[flat], positions)
        if seq.policy.uses_attention:
            seq.states[layer].observe(result.weights, flat)
        return result

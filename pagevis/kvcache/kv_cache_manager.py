"""The cache manager: every sequence's pages in one pool per layer (vLLM v1's KVCacheManager over its
KVCacheCoordinator). Above kvcache/, its pages and sequences are reached through its methods alone (block tables,
`pool`, `cached_pages`, `snapshot`, `frames`, ...): tests/test_layering.py refuses a read of its stores, its
sequences or a pool's hash tables anywhere else. Beside them callers read its settings (`config`, `pool_pages`,
`windows`), the engine and the oracle set `step` (the step its events carry) and the scheduler records each
prefix hit in `prefix_stats`.

It keeps the sequences (sequence.py: each one's policy, tokens and prefix hashes) and the one event log; each
layer's manager (layer_managers.py, one per layer spec: full attention or a sliding window) owns every sequence's
table in its layer (block table, holes, resident count, the policy's statistics: vLLM's req_to_blocks) and answers
for what differs by kind of layer; the cache manager never branches on a layer's kind itself. What a policy's
choice does to the pages is eviction.py's; attention over the pages is paged_attention.py's; storage is the
layer's PageStore (store.py) and its BlockPool.

- A page two sequences point at is not changed in place: every change (a write into a shared partial page, an
  eviction, a merge, re-rotated keys, pruned key channels, a sealed key group) asks `LayerManager.writable`,
  which copies it first (copy-on-write); the shared page keeps its K/V and its prefix hash.
- A sequence that has not evicted registers each full page under its prefix hash; a later sequence with
  the same tokens points at those pages instead of computing them (the prefix cache). A freed page keeps
  its K/V and hash until the pool reuses it. A hit is the longest prefix every layer's manager accepts.
- A per-head policy (adakv, duo) drops (KV head, token) entries: the sequence keeps one mask per layer
  and KV head (`head_keep`); a slot is freed once every KV head dropped its token. Masks belong to the
  sequence, not the page: masking a shared page copies nothing.

Every change is recorded as a CacheEvent.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from pagevis.errors import check_int
from pagevis.kvcache import eviction, paged_attention
from pagevis.kvcache.paged_attention import Chunked
from pagevis.kvcache.admission import Admission
from pagevis.kvcache.attention_kernels import AttentionResult
from pagevis.kvcache.batch_writes import write_many
from pagevis.kvcache.block_pool import BlockPool
from pagevis.kvcache.config import MAX_PAGES, CacheConfig
from pagevis.kvcache.errors import ConfigError
from pagevis.kvcache.events import CacheEvent, EventKind, EventLog
from pagevis.kvcache.key_channels import KeyChannels
from pagevis.kvcache.layer_managers import LayerManager, layer_manager
from pagevis.kvcache.policies import make_policy
from pagevis.kvcache.policies.wrappers import Policy
from pagevis.kvcache.policy_state import LayerView
from pagevis.kvcache.prefix_cache import PrefixCacheStats, page_hash, prefix_hashes, salt_root
from pagevis.kvcache.quant import storage_summary
from pagevis.kvcache.sequence import SequenceCache
from pagevis.kvcache.snapshot import CacheSnapshot, LayerFrames, layer_frames, take
from pagevis.kvcache.store import note_peak
from pagevis.kvcache.store_kinds import make_store
from pagevis.kvcache.ram_tier import TierCounts
from pagevis.kvcache.swap import SwapSpace

E = EventKind


@dataclass(frozen=True)
class PoolState:
    """One layer's pool at one moment (KVCacheManager.pool), copied: page ids, those in use (now and at most),
    each page's reference count and tokens, and the cached free pages in the order the pool reuses them."""

    layer: int
    n_pages: int
    used: int
    peak: int
    ref_counts: np.ndarray
    fill: np.ndarray
    cached_free: tuple[int, ...]


class KVCacheManager:
    """K/V pages of every layer for any number of sequences.

    `config` gives the head layout, the page size, each sequence's budget (its capacity) and policy, and
    the tiers; `pool_pages` the page ids per layer (default: the config's own, one sequence's worth: RAM
    frames, or disk frames with a disk tier, whose RAM frames stay config.max_pages).
    Per step the caller sets `step`, then per sequence and layer: `append` the new tokens' K/V, `attend`.
    """

    def __init__(self, config: CacheConfig, pool_pages: int | None = None, prefix_caching: bool = True):
        self.config = config
        self.pool_pages = config.n_page_ids if pool_pages is None else check_int("pool_pages", pool_pages, 1,
                                                                                   MAX_PAGES)
        self.page_size = config.page_size
        self.swap = SwapSpace(config.n_layers, config.page_bytes(), config.swap_dir) if config.tiered else None
        self.stores = [make_store(config, layer, self.swap.files[layer] if self.swap else None, self.pool_pages)
                       for layer in range(config.n_layers)]
        self.log = EventLog()
        self.sequences: dict[int, SequenceCache] = {}
        self.layers = [layer_manager(spec, store, self.log, self.pool_pages)
                       for spec, store in zip(config.layer_specs, self.stores, strict=True)]
        self.select_pages = config.select_pages if config.select == "quest" else None
        self.windows = tuple(layer.window for layer in self.layers)  # per layer: None (global) or W (local)
        # (commit, per sequence and step: a layer that keeps no step bookkeeping of its own only notes its pool's
        # peak, which `commit` does here without its two calls; every other layer commits itself, in order)
        plain = [type(layer).commit is LayerManager.commit and type(layer).after_step is LayerManager.after_step
                 for layer in self.layers]
        self._committing = [layer for layer, own in zip(self.layers, plain, strict=True) if not own]
        self._peak_stores = [layer.store for layer, own in zip(self.layers, plain, strict=True) if own]
        self._peaks_noted = -1  # BlockPool.grown when commit last noted their peaks
        self.prefix_caching = prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.admission = Admission(self)  # what the scheduler asks (admission.py)

    @classmethod
    def single(cls, config: CacheConfig, **kwargs) -> KVCacheManager:
        """A manager holding one sequence, id 0 (the oracle's full cache, the benches' and tests' caches)."""
        cache = cls(config, **kwargs)
        cache.add_sequence(0)
        return cache

    step = property(lambda self: self.log.step, lambda self, step: setattr(self.log, "step", step),
                    doc="The step the coming changes belong to (the caller sets it).")
    events = property(lambda self: self.log.events, doc="Events not yet taken, oldest first.")
    cow_total = property(lambda self: sum(layer.copies for layer in self.layers), doc="Copy-on-write copies made.")

    def close(self) -> None:
        """Remove the swap files now (they are removed at exit or garbage collection otherwise)."""
        if self.swap is not None:
            self.swap.close()

    def reset(self) -> None:
        """Empty every page and sequence (the sequences stay, with nothing cached); forget the prefix cache."""
        for store in self.stores:
            store.reset()
        for seq in self.sequences.values():
            seq.clear()
        for layer in self.layers:
            layer.clear()
        self.log.step = 0
        self.log.events = []

    def record_writes(self, on: bool) -> None:
        """Whether WRITE events are logged (on by default: one per token and layer, a 16-sequence decode step's 480):
        a caller whose records keep none may turn them off; every other event is logged as before, in order."""
        self.log.writes = on

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        return self.log.take()

    def take_counts(self) -> list[TierCounts]:
        """Per layer, what moved between the tiers since the last call."""
        return [store.take_counts() for store in self.stores]

    def snapshot(self, seq_id: int, shown: int, held=None) -> CacheSnapshot:
        """The sequence's cache as a step record shows it (kvcache/snapshot.py): slot maps, protected slots,
        scores, float32 slots, block-table frames, per-layer capacities and labels; `shown` frames per layer."""
        return take(self, seq_id, shown, held)

    def frames(self, layer: int) -> LayerFrames:
        """What the layer's RAM frames hold, read-only (kvcache/snapshot.py)."""
        return layer_frames(self.stores[layer])

    # --- sequences -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, policy: Policy | None = None) -> SequenceCache:
        """A new, empty sequence evicting by `policy` (default: a fresh one of the settings' policy)."""
        if seq_id in self.sequences:
            raise ConfigError("seq_id", seq_id, "an id no live sequence has")
        if policy is None:
            policy = make_policy(self.config)
        seq = SequenceCache(seq_id, policy)
        if self.config.key_channels:
            seq.channels = KeyChannels(self.config.n_layers, self.config.key_channels, self.config.head_dim)
        self.sequences[seq_id] = seq
        for layer in self.layers:
            layer.add(seq)
        return seq

    def free(self, seq_id: int, kind: EventKind | None = E.FREE) -> None:
        """Drop the sequence; its pages go back to the free queue when no other sequence uses them
        (last pages first, so a cached prefix outlives its tail). kind None: no event."""
        self.log.acting = seq_id
        seq = self.sequences.pop(seq_id)
        for layer in self.layers:
            layer.free(seq)
        if kind is not None:
            self.log.add(kind, seq_id)

    def match_prefix(self, seq_id: int, token_ids, cache_salt: str | None = None) -> int:
        """Point an empty sequence at the cached pages of token_ids' longest cached full-page prefix
        (leaving at least the last token to compute): the longest every layer's manager accepts. Returns the
        number of tokens reused. The caller counts the lookup in `prefix_stats` once the sequence is admitted.
        `cache_salt`: its pages hash from the salt's root (only the same salt shares them)."""
        seq = self.sequences[seq_id]
        if any(layer.table(seq).pages for layer in self.layers) or not self.prefix_caching:
            return 0
        seq.root = salt_root(cache_salt)
        hashes = prefix_hashes(token_ids[: len(token_ids) - 1], self.page_size, seq.root)
        n = len(hashes)
        while (shorter := min(layer.longest_hit(hashes, n) for layer in self.layers)) < n:
            n = shorter  # until every layer accepts the same length (vLLM's hybrid coordinator does the same)
        hit_pages = [layer.hit_pages(hashes[:n]) for layer in self.layers]
        for i in range(n):
            for layer, pages in zip(self.layers, hit_pages, strict=True):
                if (page := pages[i]) is not None:
                    layer.share(seq, page, first_position=i * self.page_size)
            seq.hashes.append(hashes[i])
        n_tokens = n * self.page_size
        seq.token_ids = [int(t) for t in token_ids[:n_tokens]]
        seq.newest = n_tokens - 1
        for layer in self.layers:
            layer.after_hit(seq, n_tokens)
        if n_tokens:
            self.log.add(E.PREFIX_HIT, seq_id, detail=n_tokens)
        return n_tokens

    def fork(self, parent_id: int, child_id: int, n_tokens: int | None = None) -> SequenceCache:
        """A new sequence that reads the parent's first n_tokens tokens (all by default) without copying:
        it shares every page whose tokens all come before n_tokens; a page holding later tokens too is
        copied with those masked out. The child gets a copy of the parent's policy and statistics."""
        parent = self.sequences[parent_id]
        n = len(parent.token_ids) if n_tokens is None else check_int("n_tokens", n_tokens, 0, len(parent.token_ids))
        for layer in self.layers:
            layer.check_fork(parent, n)
        if child_id in self.sequences:
            raise ConfigError("seq_id", child_id, "an id no live sequence has")
        child = self.sequences[child_id] = SequenceCache(
            child_id, copy.deepcopy(parent.policy), token_ids=parent.token_ids[:n],
            hashes=parent.hashes[: n // self.page_size], hashable=parent.hashable, root=parent.root, newest=n - 1,
            channels=copy.deepcopy(parent.channels))
        self.log.acting = child_id
        for layer in self.layers:
            layer.fork(parent, child, n)
        self.log.add(E.FORK, child_id, detail=parent_id)
        return child

    # --- questions -------------------------------------------------------------------------------
    def block_table(self, seq_id: int, layer: int = 0) -> list[int]:
        return self.layers[layer].table(self.sequences[seq_id]).pages

    def n_tokens(self, seq_id: int) -> int:
        """Positions written so far (the next one to write): what a global layer holds if nothing was evicted."""
        return self.sequences[seq_id].newest + 1

    def resident(self, seq_id: int, layer: int) -> int:
        return self.layers[layer].table(self.sequences[seq_id]).resident

    def pages_used(self, layer: int = 0) -> int:
        return self.stores[layer].pages.n_used()

    def pages_unshared(self, layer: int = 0) -> int:
        """Pages the live sequences would hold if none were shared (the sum of their block tables)."""
        return sum(len(table.pages) for table in self.layers[layer].tables.values())

    def head_entries(self, seq_id: int, layer: int) -> int:
        """(KV head, token) entries the sequence holds in the layer: what a per-head policy's budget counts,
        n_kv_heads per resident token for a token-level policy. Each entry is one KV head's key and value
        of one token (2 x head_dim values); the slots hold the union of the heads' tokens."""
        return self.layers[layer].head_entries(self.sequences[seq_id])

    def view(self, seq_id: int, layer: int) -> LayerView:
        """What the sequence's policy reads: positions of its own slots (the live store array when it is
        the only sequence; a masked copy otherwise)."""
        return self.layers[layer].view(self.sequences[seq_id])

    def slot_positions(self, layer: int) -> np.ndarray:
        """Token position of each flat slot in the allocated prefix (what a single sequence's weights index)."""
        store = self.stores[layer]
        return store.positions[: store.high_water * store.page_size]

    def flat_slots(self, seq_id: int, layer: int) -> np.ndarray:
        """The flat slots of the sequence's pages in the layer, in logical order (slots.py)."""
        return self.layers[layer].flat(self.sequences[seq_id])

    def resident_positions(self, seq_id: int, layer: int) -> np.ndarray:
        positions = self.stores[layer].positions[self.flat_slots(seq_id, layer)]
        return np.sort(positions[positions >= 0])

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.sequences

    def seq_ids(self) -> list[int]:
        """The live sequences, oldest first."""
        return list(self.sequences)

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table of every layer (live lists: they change with the next step)."""
        seq = self.sequences[seq_id]
        return [layer.table(seq).pages for layer in self.layers]

    def policy(self, seq_id: int) -> Policy:
        """The policy the sequence evicts by."""
        return self.sequences[seq_id].policy

    def token_ids(self, seq_id: int) -> list[int]:
        """The tokens whose K/V the sequence wrote, in position order."""
        return self.sequences[seq_id].token_ids

    def read_slots(self, seq_id: int) -> list[np.ndarray | None]:
        """Per layer, the flat slots the sequence's last attention there read (None: every resident slot)."""
        seq = self.sequences[seq_id]
        return [layer.table(seq).read_slots for layer in self.layers]

    def head_keep(self, seq_id: int, layer: int) -> np.ndarray | None:
        """(n_kv_heads, n_slots) bool, the KV heads that keep each slot's token (a per-head policy's masks; None
        for a token policy), read-only."""
        keep = self.layers[layer].table(self.sequences[seq_id]).head_keep
        return None if keep is None else _read_only(keep)

    # --- the pool, for records and reports --------------------------------------------------------
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """The layers by kind, in layer order: 'global' and, on a hybrid model (Gemma 3), 'local W=...' (its
        sliding-window layers). Each layer has its own pool of `pool_pages` page ids."""
        groups: dict[str, list[int]] = {}
        for layer, spec in enumerate(self.config.layer_specs):
            groups.setdefault(spec.label, []).append(layer)
        return {label: tuple(layers) for label, layers in groups.items()}

    def resident_by_layers(self, seq_id: int) -> dict[str, tuple[int, ...]]:
        """Per kind of layer (`layer_groups`), the tokens the sequence holds in each of those layers (none once
        it is freed)."""
        seq = self.sequences.get(seq_id)
        return {label: tuple(0 if seq is None else self.layers[layer].table(seq).resident for layer in layers)
                for label, layers in self.layer_groups().items()}

    def pool(self, layer: int = 0) -> PoolState:
        """The layer's pool now, copied: what a record or a report shows of it."""
        store = self.stores[layer]
        pages = store.pages
        return PoolState(layer=layer, n_pages=pages.n_frames, used=pages.n_used(), peak=store.used_peak,
                         ref_counts=pages.ref_counts.copy(), fill=store.fill.copy(),
                         cached_free=tuple(pages.cached_free()))

    def cached_pages(self, layer: int = 0) -> Mapping[int, int]:
        """Prefix hash -> page, for every full page the layer's pool holds under its hash (in use or cached free),
        read-only and live (it changes with the next step)."""
        return MappingProxyType(self.stores[layer].pages.hash_frame)

    def page_hash(self, layer: int, page: int) -> int | None:
        """The prefix hash the page stands for (None: none)."""
        return self.stores[layer].pages.frame_hash.get(page)

    def storage(self) -> dict:
        """What the cache's K/V storage costs and held at most, for reports (quant.storage_summary)."""
        return storage_summary(self.config, self.stores)

    def take_memory(self) -> None:
        """Write every page of the pool once, so that its memory is taken now rather than as pages fill (a
        server's, as vLLM's: its resident size is flat from the start: a sliding-window layer keeps it too)."""
        for store in self.stores:
            for array in store.kv_arrays():
                array.fill(0)
            store.gives_back = False

    # --- writing ---------------------------------------------------------------------------------
    def extend(self, seq_id: int, token_ids) -> None:
        """The token ids whose K/V the coming `append` calls write (prefix hashes need them)."""
        self.sequences[seq_id].token_ids.extend(int(t) for t in token_ids)

    def append(self, seq_id: int, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions into the sequence's own
        pages, evicting (its policy) at its budget and copying any shared page before changing it."""
        self.log.acting = seq_id
        seq = self.sequences[seq_id]
        eviction.append(self.layers[layer], seq, k, v, positions)
        if len(positions):
            seq.newest = max(seq.newest, int(positions[-1]))

    def append_many(self, seq_ids: list[int], layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """`append` of one token for each of several sequences (k, v (B, n_kv_heads, head_dim), positions (B,)), with
        the pages, tables, events and K/V of B `append` calls in that order: on float32 RAM pages the tokens that
        need only a slot are written by one call (batch_writes.py), the others one `append` each."""
        self._append_many([self.sequences[s] for s in seq_ids], layer, k, v, positions)

    def _append_many(self, seqs: list[SequenceCache], layer: int, k: np.ndarray, v: np.ndarray,
                     positions: np.ndarray, hold: bool = False) -> np.ndarray | None:
        """hold: batch_writes.write_many's (the flat slots of tokens whose K/V are left to the attention call, or
        None: all written)."""
        manager = self.layers[layer]
        if manager.store.in_place:  # (which also sets each sequence's newest position)
            return write_many(manager, seqs, k, v, positions, lambda i: eviction.append(
                manager, seqs[i], k[i: i + 1], v[i: i + 1], positions[i: i + 1]), hold)
        for i, seq in enumerate(seqs):
            self.log.acting = seq.seq_id
            eviction.append(manager, seq, k[i: i + 1], v[i: i + 1], positions[i: i + 1])
        for seq, position in zip(seqs, positions.tolist(), strict=True):
            if position > seq.newest:
                seq.newest = position
        return None

    def commit(self, seq_id: int, prompt_done: bool = False) -> None:
        """After a step: register the sequence's newly full pages under their prefix hashes. With key_channels
        (ThinK), once its prompt is done or its cache full, choose each layer's key channels and prune them."""
        seq, ps = self.sequences[seq_id], self.page_size
        if seq.channels is not None and not seq.channels.chosen and (
                prompt_done or self.admission.free_slots(seq_id) <= 0):
            eviction.prune_key_channels(self.layers, seq)
        while seq.hashable and self.prefix_caching and (len(seq.hashes) + 1) * ps <= len(seq.token_ids):
            i, parent = len(seq.hashes), seq.hashes[-1] if seq.hashes else seq.root
            seq.hashes.append(page_hash(parent, seq.token_ids[i * ps: (i + 1) * ps]))
            for layer in self.layers:
                layer.register(seq, i, seq.hashes[-1])
        for layer in self._committing:  # (each layer changes only its own store: the order between the two holds)
            layer.commit(seq)
        if BlockPool.grown != self._peaks_noted:  # (no pool grew since they were noted: none can be higher)
            self._peaks_noted = BlockPool.grown
            for store in self._peak_stores:  # (LayerManager.commit without its after_step call)
                note_peak(store)

    def compress(self, seq_id: int, reconstructed: int, note: str) -> None:
        """A compressing policy's one-shot drops (kvzip), every layer at once, after its reconstruction pass
        fed `reconstructed` tokens (a RECONSTRUCT event, `note` its reason)."""
        self.log.acting = seq_id
        seq = self.sequences[seq_id]
        self.log.add(E.RECONSTRUCT, seq_id, policy=seq.policy.name, reason=note, detail=reconstructed)
        eviction.compress(self.layers, seq)

    # --- attention (paged_attention.py) --------------------------------------------------------------
    def attend(self, seq_id: int, layer: int, q: np.ndarray, positions: np.ndarray,
               all_weights: bool = True) -> AttentionResult:
        """Attention of the sequence's n queries (n, n_heads, head_dim) at `positions` over its resident
        tokens. Weights come back over flat slots: the pool's allocated prefix when `slots` is None (a
        single sequence in RAM), else over `result.slots`; exactly 0 on empty slots. all_weights False: only the
        last query's weights are wanted (a long prefill's are then never whole in memory; paged_attention.attend)."""
        self.log.acting = seq_id
        manager, seq = self.layers[layer], self.sequences[seq_id]
        result = paged_attention.attend(manager, seq, q, positions, self.select_pages, all_weights=all_weights)
        if len(positions) > 1:  # (a local layer lets go of a long chunk's pages below its window now)
            manager.attended(seq, int(positions[-1]))
        return result

    def write_and_attend(self, seq_id: int, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                         positions: np.ndarray, all_weights: bool = True) -> AttentionResult:
        """`append` then `attend` of the sequence's n tokens (q (n, n_heads, head_dim), k, v (n, n_kv_heads,
        head_dim)): for a decoding token, where nothing else is due, one kernel call that writes its K/V and
        attends (paged_attention.write_and_attend). all_weights: `attend`'s."""
        if len(positions) == 1 and self.select_pages is None:
            self.log.acting = seq_id
            seq, position = self.sequences[seq_id], int(positions[0])
            result = paged_attention.write_and_attend(self.layers[layer], seq, q, k[0], v[0], positions)
            if result is not None:
                seq.newest = max(seq.newest, position)
                return result
        self.append(seq_id, layer, k, v, positions)
        return self.attend(seq_id, layer, q, positions, all_weights)

    def attend_beside(self, seq_id: int, layer: int, q: np.ndarray, positions: np.ndarray, k: np.ndarray,
                      v: np.ndarray, own_positions: np.ndarray) -> AttentionResult:
        """Attention of queries whose tokens are not cached (kvzip's reconstruction pass): paged_attention.py."""
        return paged_attention.attend_beside(self.layers[layer], self.sequences[seq_id], q, positions, k, v,
                                             own_positions)

    def can_attend_many(self, seq_ids: list[int], layer: int) -> bool:
        """Whether `attend_many` serves these sequences (several, in RAM, unquantized, no selection or masks)."""
        return len(seq_ids) > 1 and paged_attention.can_attend_many(
            self.layers[layer], [self.sequences[s] for s in seq_ids], self.select_pages)

    def decode_many(self, seq_ids: list[int], layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    positions: np.ndarray, wanted=()) -> tuple[np.ndarray, dict[int, AttentionResult]] | None:
        """`append_many` then `attend_many` where `can_attend_many` (else None: nothing written), the output as one
        (B, n_heads, head_dim) array and the AttentionResult of the rows in `wanted` (indices into seq_ids) only: a
        batched decode step's layer. When every token needs only a slot (float32 RAM pages), the batched attention's
        call writes their K/V (batch_writes.write_many's `hold`): the same cache, one numba call less."""
        seqs = [self.sequences[s] for s in seq_ids]
        if not paged_attention.can_attend_many(self.layers[layer], seqs, self.select_pages):  # (two or more)
            return None
        held = self._append_many(seqs, layer, k, v, positions, hold=True)  # (their K/V: the attention call writes them)
        return paged_attention.attend_stacked(self.layers[layer], seqs, q, positions, wanted,
                                              None if held is None else (held, k, v))

    def attend_chunks(self, seq_ids: list[int], layer: int, q, positions, starts, wanted=()) -> Chunked:
        """paged_attention.attend_chunks of these sequences' appended rows (q[starts[i]: starts[i + 1]]), or None."""
        return paged_attention.attend_chunks(self.layers[layer], [self.sequences[s] for s in seq_ids], q, positions,
                                             starts, wanted, self.select_pages)

    def attend_many(self, seq_ids: list[int], layer: int, q: np.ndarray, positions: np.ndarray
                    ) -> list[AttentionResult]:
        """`attend` for several sequences that each decode one token, in one batched kernel."""
        return paged_attention.attend_many(self.layers[layer], [self.sequences[s] for s in seq_ids], q, positions)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view

"""The cache manager: every sequence's pages in one pool per layer — what the scheduler and the model's
attention see of the cache.

Each layer has one PageStore (K/V, positions, the disk tier) whose BlockPool counts references. Each
sequence has its own block table per layer (policies evict per layer and leave holes, so the tables stay
per layer, unlike vLLM's), its own eviction policy and statistics, and a token budget of the cache
settings' capacity; the pool's pages are shared by all sequences.

- A page two sequences point at is never written: the writer copies it first (copy-on-write), whether it
  appends into a shared partial page or its policy evicts a token from a shared page.
- A sequence that has not evicted registers each full page under its prefix hash; a later sequence with
  the same tokens points at those pages instead of computing them (the prefix cache). A freed page keeps
  its K/V and hash until the pool reuses it.
- Attention of a single live sequence reads the pool's used prefix in place (no gather); with several,
  each reads its own pages through its block table; with a disk tier or Quest, through the reader.
- A per-head policy (adakv, duo) drops (KV head, token) entries: the sequence keeps one mask per layer
  and KV head (`head_keep`), attention adds -inf for the entries a head dropped (each KV head's queries
  attend alone), and a slot is freed (an ordinary eviction) once every KV head dropped its token. Masks
  belong to the sequence, not the page: masking a shared page copies nothing.
- A local layer (a sliding window, spec.py) drops each page none of whose tokens the sequence's newest query
  sees (a SLIDE event, then a release if no other sequence uses it), before each write and after each step;
  its attention masks keys beyond the window. A policy's budget applies there only when it is smaller than
  the window. Its prefix hit needs only the pages of the last window (found right to left, as vLLM's
  SlidingWindowManager does); the block table then starts at logical page `dropped`.

Every change is recorded as a CacheEvent.

Why one module of about 950 lines: it is the only code that changes pages, and append, evict, copy-on-write,
fork, the prefix cache and attention all read and write the same per-sequence tables, the pool's reference
counts and one event list; the pieces without that state already live beside it (block_pool, store, reader,
prefix hashing, events, key_channels). It grew by ThinK's pruning and kvzip's read-only attention
(`attend_beside`) this round: those two are the next to move out, into modules that take the tables they read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from pagevis.errors import check_int
from pagevis.kvcache.attention import AttentionResult, attend, attend_decode_batch
from pagevis.kvcache.config import MAX_PAGES, CacheConfig
from pagevis.kvcache.errors import CacheFullError, ConfigError
from pagevis.kvcache.events import CacheEvent, EventKind
from pagevis.kvcache.key_channels import KeyChannels
from pagevis.kvcache.policies import EvictionPolicy, make_policy
from pagevis.kvcache.snapshot import CacheSnapshot, LayerFrames, layer_frames, take
from pagevis.kvcache.policy_state import LayerView, PolicyState
from pagevis.kvcache.prefix_cache import ROOT_HASH, PrefixCacheStats, page_hash, prefix_hashes
from pagevis.kvcache.reader import read_attention
from pagevis.kvcache.spec import first_kept_page, first_visible
from pagevis.kvcache.rope_shift import inverse_frequencies, rotate
from pagevis.kvcache.store import PageStore, TierCounts
from pagevis.kvcache.swap import SwapSpace

# With a disk tier, prefill chunks are cut so that their scores over a batch of frames, and their weights
# over every slot when the policy learns from attention, stay under this many float32 values (32 MB).
MAX_CHUNK_WEIGHTS = 8 << 20
# With a disk tier the free slots no longer bound a prefill chunk; this does, so that a long prompt's
# transient arrays (and the process's memory after them) do not grow with the context.
MAX_TIERED_CHUNK = 1024

E = EventKind


@dataclass
class SequenceCache:
    """One sequence's share of the cache: per layer its block table (page ids in logical order), the empty
    slots of its own pages, its resident tokens; its policy and statistics; the tokens it wrote (for prefix
    hashes)."""

    seq_id: int
    policy: EvictionPolicy
    states: list[PolicyState]
    block_tables: list[list[int]]
    holes: list[set[int]]
    resident: list[int]
    read_slots: list[np.ndarray | None]  # per layer, the flat slots its last attention read (None: all)
    # per layer, (n_kv_heads, n_slots) bool: the KV heads that keep each slot's token (per-head policies only)
    head_keep: list[np.ndarray | None]
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are written, in position order
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full logical page, while hashable
    hashable: bool = True  # False once the sequence evicted: its pages no longer hold whole prefixes
    # local layers: per layer, the logical pages slid off the front of its table, the newest position slid out
    dropped: list[int] = field(default_factory=list)
    slid: list[int] = field(default_factory=list)
    newest: int = -1  # the newest position written (its query is the one a sliding window follows)
    channels: KeyChannels | None = None  # ThinK (key_channels): the query window, then the key channels kept

    def clear(self) -> None:
        for layer, table in enumerate(self.block_tables):
            table.clear()
            self.holes[layer].clear()
            self.resident[layer] = 0
            self.read_slots[layer] = None
            self.states[layer].reset()
            if self.head_keep[layer] is not None:
                self.head_keep[layer].fill(False)
            self.dropped[layer], self.slid[layer] = 0, -1
        self.newest = -1
        self.policy.reset()
        if self.channels is not None:
            self.channels.reset()
        self.token_ids.clear()
        self.hashes.clear()
        self.hashable = True


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
        self.stores = [PageStore(config, layer, self.swap.files[layer] if self.swap else None, self.pool_pages)
                       for layer in range(config.n_layers)]
        for store in self.stores:
            store.on_move = self._move_event(store.layer)
        self.select_pages = config.select_pages if config.select == "quest" else None
        self.windows = tuple(spec.window for spec in config.layer_specs)  # per layer: None (global) or W (local)
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_base)  # re-rotation's RoPE frequencies
        self.prefix_caching = prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.sequences: dict[int, SequenceCache] = {}
        self.step = 0
        self.events: list[CacheEvent] = []
        self.cow_total = 0
        self._acting = -1  # the sequence the current change is for (tier moves are named after it)

    @classmethod
    def single(cls, config: CacheConfig, **kwargs) -> KVCacheManager:
        """A manager holding one sequence, id 0 (the oracle's full cache, the benches' and tests' caches)."""
        cache = cls(config, **kwargs)
        cache.add_sequence(0)
        return cache

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
        self.step = 0
        self.events = []

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

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
    def add_sequence(self, seq_id: int, policy: EvictionPolicy | None = None) -> SequenceCache:
        """A new, empty sequence evicting by `policy` (default: a fresh one of the settings' policy)."""
        if seq_id in self.sequences:
            raise ConfigError("seq_id", seq_id, "an id no live sequence has")
        policy = policy or make_policy(self.config)
        n_layers = self.config.n_layers
        head_keep = [np.zeros((self.config.n_kv_heads, store.n_slots), dtype=bool) if policy.per_head else None
                     for store in self.stores]
        seq = SequenceCache(seq_id, policy, [policy.make_state(store.n_slots) for store in self.stores],
                            [[] for _ in range(n_layers)], [set() for _ in range(n_layers)], [0] * n_layers,
                            [None] * n_layers, head_keep, dropped=[0] * n_layers, slid=[-1] * n_layers)
        if self.config.key_channels:
            seq.channels = KeyChannels(n_layers, self.config.key_channels, self.config.head_dim)
        self.sequences[seq_id] = seq
        return seq

    def free(self, seq_id: int, kind: EventKind | None = E.FREE) -> None:
        """Drop the sequence; its pages go back to the free queue when no other sequence uses them
        (last pages first, so a cached prefix outlives its tail). kind None: no event."""
        self._acting = seq_id
        seq = self.sequences.pop(seq_id)
        for layer, (store, table) in enumerate(zip(self.stores, seq.block_tables, strict=True)):
            for page in reversed(table):
                if store.release(page):
                    self._event(E.RELEASE, seq_id, layer, page)
        if kind is not None:
            self._event(kind, seq_id)

    def match_prefix(self, seq_id: int, token_ids) -> int:
        """Point an empty sequence at the cached pages of token_ids' longest cached full-page prefix
        (leaving at least the last token to compute). Returns the number of tokens reused. The caller
        counts the lookup in `prefix_stats` once the sequence is admitted."""
        seq = self.sequences[seq_id]
        if any(seq.block_tables) or not self.prefix_caching:
            return 0
        ps = self.page_size
        hashes = prefix_hashes(token_ids[: len(token_ids) - 1], ps)
        hit = []  # per full page, its hash and its page in each layer (None: a local layer does not need it)
        for h in hashes:
            pages = [None if window else store.pages.lookup(h) for store, window in zip(self.stores, self.windows,
                                                                                         strict=True)]
            if any(page is None for page, window in zip(pages, self.windows, strict=True) if not window):
                break
            hit.append((h, pages))
        hit = self._window_hit(hit)
        hit = self._whole_key_groups(hit)
        for i, (h, pages) in enumerate(hit):
            for layer, page in enumerate(pages):
                if page is not None:
                    self._share(seq, layer, page, first_position=i * ps)
            seq.hashes.append(h)
        n_tokens = len(hit) * ps
        seq.token_ids = [int(t) for t in token_ids[:n_tokens]]
        seq.newest = n_tokens - 1
        for layer, window in enumerate(self.windows):
            if window and n_tokens:
                seq.dropped[layer] = first_kept_page(n_tokens, window, ps)
                seq.slid[layer] = seq.dropped[layer] * ps - 1
        if n_tokens:
            self._event(E.PREFIX_HIT, seq_id, detail=n_tokens)
        return n_tokens

    def _window_hit(self, hit: list) -> list:
        """The longest prefix of a hit (cached in every global layer) whose last window is cached in every local
        layer too, found right to left (vLLM's SlidingWindowManager); its local layers' pages filled in from the
        first one each keeps."""
        ps, n = self.page_size, len(hit)
        local = [layer for layer, window in enumerate(self.windows) if window]
        runs = {}  # per local layer: cached pages in a row ending at each logical page
        for layer in local:
            pages = [self.stores[layer].pages.lookup(h) for h, _ in hit]
            run, length = [], 0
            for page in pages:
                length = length + 1 if page is not None else 0
                run.append(length)
            runs[layer] = (pages, run)
        while n and not all(runs[layer][1][n - 1] >= n - first_kept_page(n * ps, self.windows[layer], ps)
                            for layer in local):
            n -= 1
        hit = hit[:n]
        for layer in local:
            for i in range(first_kept_page(n * ps, self.windows[layer], ps) if n else 0, n):
                hit[i][1][layer] = runs[layer][0][i]
        return hit

    def fork(self, parent_id: int, child_id: int, n_tokens: int | None = None) -> SequenceCache:
        """A new sequence that reads the parent's first n_tokens tokens (all by default) without copying:
        it shares every page whose tokens all come before n_tokens; a page holding later tokens too is
        copied with those masked out. The child gets a copy of the parent's policy and statistics."""
        parent = self.sequences[parent_id]
        n = len(parent.token_ids) if n_tokens is None else check_int("n_tokens", n_tokens, 0, len(parent.token_ids))
        for layer, window in enumerate(self.windows):
            if window and n and parent.slid[layer] >= first_visible(n, window):
                raise ConfigError("n_tokens", n, f"at least {parent.slid[layer] + window} for sequence {parent_id}: "
                                  f"local layer {layer} (window {window}) no longer holds position "
                                  f"{parent.slid[layer]}")
        child = self.add_sequence(child_id)
        child.policy = copy.deepcopy(parent.policy)
        child.states = [copy.deepcopy(state) for state in parent.states]
        child.head_keep = [None if keep is None else keep.copy() for keep in parent.head_keep]
        child.channels = copy.deepcopy(parent.channels)
        child.token_ids = parent.token_ids[:n]
        child.hashable = parent.hashable
        child.hashes = parent.hashes[: n // self.page_size]
        child.dropped, child.slid, child.newest = list(parent.dropped), list(parent.slid), n - 1
        ps = self.page_size
        self._acting = child_id
        for layer, store in enumerate(self.stores):
            for page in parent.block_tables[layer]:
                positions = store.positions[page * ps: (page + 1) * ps]
                keep = (positions >= 0) & (positions < n)
                if not keep.any():
                    continue
                if keep.sum() == store.fill[page]:
                    self._share(child, layer, page)
                else:
                    self._copy_page(child, layer, page, keep)
            self._slide(child, layer)
        self._event(E.FORK, child_id, detail=parent_id)
        return child

    def _share(self, seq: SequenceCache, layer: int, page: int, first_position: int | None = None) -> None:
        """One more table entry of seq points at page (in use, or a cached free page, restored)."""
        store, ps = self.stores[layer], self.page_size
        was_free = store.pages.ref_counts[page] == 0
        store.pages.share(page)
        if was_free:
            store.restore(page, first_position)
        seq.block_tables[layer].append(page)
        seq.resident[layer] += int(store.fill[page])
        held = store.positions[page * ps: (page + 1) * ps] >= 0
        seq.holes[layer].update((page * ps + np.flatnonzero(~held)).tolist())
        if seq.head_keep[layer] is not None and first_position is not None:  # a prefix hit: all heads keep it
            seq.head_keep[layer][:, page * ps: (page + 1) * ps] = held  # (a fork keeps its parent's masks)
        self._event(E.SHARE, seq.seq_id, layer, page, detail=int(store.pages.ref_counts[page]))

    # --- questions -------------------------------------------------------------------------------
    def block_table(self, seq_id: int, layer: int = 0) -> list[int]:
        return self.sequences[seq_id].block_tables[layer]

    def n_tokens(self, seq_id: int) -> int:
        """Positions written so far (the next one to write): what a global layer holds if nothing was evicted."""
        return self.sequences[seq_id].newest + 1

    def resident(self, seq_id: int, layer: int) -> int:
        return self.sequences[seq_id].resident[layer]

    def n_free(self) -> int:
        """Pages free in every layer (cached free pages included)."""
        return min(store.pages.n_free() for store in self.stores)

    def pages_used(self, layer: int = 0) -> int:
        return self.stores[layer].pages.n_used()

    def pages_unshared(self, layer: int = 0) -> int:
        """Pages the live sequences would hold if none were shared (the sum of their block tables)."""
        return sum(len(seq.block_tables[layer]) for seq in self.sequences.values())

    def head_entries(self, seq_id: int, layer: int) -> int:
        """(KV head, token) entries the sequence holds in the layer: what a per-head policy's budget counts,
        n_kv_heads per resident token for a token-level policy. Each entry is one KV head's key and value
        of one token (2 x head_dim values); the slots hold the union of the heads' tokens."""
        seq = self.sequences[seq_id]
        keep = seq.head_keep[layer]
        if keep is None:
            return seq.resident[layer] * self.config.n_kv_heads
        flat = self._flat_slots(seq.block_tables[layer])
        return int((keep[:, flat] & (self.stores[layer].positions[flat] >= 0)).sum())

    def free_slots(self, seq_id: int) -> int:
        """Tokens every layer of the sequence can take before its policy must evict: its budget (a policy
        may give a layer less: pyramidkv), and the pool."""
        seq, ps = self.sequences[seq_id], self.page_size
        return min(min(len(seq.holes[layer]) + store.pages.n_free() * ps, self._budget(seq, layer) - seq.resident[layer])
                   for layer, store in enumerate(self.stores))

    def layer_budget(self, seq_id: int, layer: int) -> int:
        """Tokens the layer may hold before the sequence's policy evicts there: its policy's budget, except on a
        local layer whose window is the smaller bound (there the window slides and the policy never runs)."""
        return self._budget(self.sequences[seq_id], layer)

    def _budget(self, seq: SequenceCache, layer: int) -> int:
        budget, window = seq.policy.layer_capacity(layer), self.windows[layer]
        return budget if window is None or budget < window else max(budget, self.pool_pages * self.page_size)

    def room(self, seq_id: int) -> int:
        """Tokens the sequence can still add before its policy must evict (its budget, not the pool; for a
        per-head policy also before it must drop an entry, so that a prefill chunk never evicts mid-chunk on
        statistics that have not seen the chunk; likewise for a policy that prunes at any fill)."""
        seq = self.sequences[seq_id]
        rooms = [self._budget(seq, layer) - seq.resident[layer] for layer in range(len(self.stores))]
        if seq.policy.per_head:
            rooms += [seq.policy.head_room(self.view(seq_id, layer)) for layer in range(len(self.stores))]
        if seq.policy.prunes:
            rooms += [seq.policy.prune_room(self.view(seq_id, layer)) for layer in range(len(self.stores))]
        return min(rooms)

    def can_append(self, seq_id: int, n: int) -> bool:
        """Whether n more tokens fit, by eviction if the policy evicts. Check before a step so that a
        full cache fails before any layer has changed."""
        return self.sequences[seq_id].policy.evicts or self.free_slots(seq_id) >= n

    def pages_needed(self, seq_id: int, n_tokens: int) -> list[int]:
        """Per layer, an upper bound on the pages writing n_tokens more will take from the pool."""
        seq, ps = self.sequences[seq_id], self.page_size
        needs = []
        for layer, store in enumerate(self.stores):
            table = seq.block_tables[layer]
            fill = store.fill[table] if table else np.zeros(0, dtype=np.int64)
            shared = store.pages.ref_counts[table] > 1 if table else np.zeros(0, dtype=bool)
            room = len(seq.holes[layer])
            budget = self._budget(seq, layer)
            n_evict = max(0, seq.resident[layer] + n_tokens - budget) if seq.policy.evicts else 0
            if n_evict:  # compress_every N evicts N at each time the budget is reached
                n_evict += seq.policy.compress_every - 1
            need = int((shared & (fill < ps)).sum()) + min(n_evict, int(shared.sum()))
            if store.kivi:  # quantizing a key group copies the shared pages it touches
                need += min(int(shared.sum()), -(-store.layout.group // ps) + 1)
            if (seq.policy.prunes or (n_evict and (seq.policy.rerotate or seq.policy.merges))
                    or (seq.channels is not None and not seq.channels.chosen)):
                need += int(shared.sum())  # pruned tokens or key channels, rotated keys, merged values: any shared page
            need += -(-max(0, n_tokens - room - n_evict) // ps)
            needs.append(need)
        return needs

    def pages_bound(self, seq_id: int, n_tokens: int) -> int:
        """A cheap upper bound on every layer's `pages_needed`: each of its copy-on-write terms copies at most
        every page of the table once."""
        longest = max(len(table) for table in self.sequences[seq_id].block_tables)
        return 3 * longest + -(-n_tokens // self.page_size)

    def fewest_free(self) -> int:
        """Free pages of the layer that has the fewest."""
        return min(store.pages.n_free() for store in self.stores)

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

    def view(self, seq_id: int, layer: int) -> LayerView:
        """What the sequence's policy reads: positions of its own slots (the live store array when it is
        the only sequence; a masked copy otherwise)."""
        seq, store = self.sequences[seq_id], self.stores[layer]
        table = seq.block_tables[layer]
        positions = store.positions
        if len(self.sequences) > 1:
            positions = np.full(store.n_slots, -1, dtype=np.int64)
            flat = self._flat_slots(table)
            positions[flat] = store.positions[flat]
        return LayerView(layer, self.page_size, positions, table, seq.states[layer], seq.head_keep[layer])

    def weight_positions(self, seq_id: int, layer: int, result: AttentionResult) -> np.ndarray:
        """Token position of each weight column of an `attend` result."""
        if result.slots is None:
            return self.slot_positions(layer)
        return self.stores[layer].positions[result.slots]

    def slot_positions(self, layer: int) -> np.ndarray:
        """Token position of each flat slot in the allocated prefix (what a single sequence's weights index)."""
        store = self.stores[layer]
        return store.positions[: store.high_water * store.page_size]

    def resident_positions(self, seq_id: int, layer: int) -> np.ndarray:
        positions = self.stores[layer].positions[self._flat_slots(self.sequences[seq_id].block_tables[layer])]
        return np.sort(positions[positions >= 0])

    def _flat_slots(self, table: list[int]) -> np.ndarray:
        pages = np.asarray(table, dtype=np.int64)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()

    # --- writing ---------------------------------------------------------------------------------
    def ensure_room(self, seq_id: int, n: int) -> None:
        """Raise before anything changes if n tokens cannot go in: CacheFullError from policy 'none',
        SwapSpaceError when the disk tier has no space for the pages they may need."""
        if not self.can_append(seq_id, n):
            self.sequences[seq_id].policy.choose_victims(self.view(seq_id, 0))  # raises CacheFullError
        for store, need in zip(self.stores, self.pages_needed(seq_id, n), strict=True):
            store.reserve(need)

    def extend(self, seq_id: int, token_ids) -> None:
        """The token ids whose K/V the coming `append` calls write (prefix hashes need them)."""
        self.sequences[seq_id].token_ids.extend(int(t) for t in token_ids)

    def append(self, seq_id: int, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions into the sequence's own
        pages, evicting (its policy) at its budget and copying any shared page before changing it."""
        self._acting = seq_id
        seq, store = self.sequences[seq_id], self.stores[layer]
        if store.kivi:
            self._seal_residual(seq, layer, len(positions))
        if self.windows[layer] and len(positions):
            self._slide(seq, layer, int(positions[0]) - 1)
        state, holes, keep = seq.states[layer], seq.holes[layer], seq.head_keep[layer]
        budget = self._budget(seq, layer)
        if seq.channels is not None:
            k = seq.channels.prune(layer, k)
        for i, position in enumerate(positions):
            if keep is not None:
                self._evict_heads(seq, layer)
            if seq.policy.prunes:
                self._prune(seq, layer)
            if seq.resident[layer] >= budget or not (holes or store.pages.can_allocate()):
                if not seq.policy.evicts and seq.resident[layer] < budget:
                    raise CacheFullError(f"the pool's {self.pool_pages} pages of layer {layer} are all in use "
                                         f"(sequence {seq_id} needs one more)")
                self._evict(seq, layer)
            flat = self._free_slot(seq, layer)
            store.write(flat, k[i], v[i], int(position))
            holes.remove(flat)
            seq.resident[layer] += 1
            state.clear(flat)
            state.write(flat, k[i], v[i], int(position))
            if keep is not None:
                keep[:, flat] = True
            self._event(E.WRITE, seq_id, layer, *divmod(flat, self.page_size), int(position))
        if len(positions):
            seq.newest = max(seq.newest, int(positions[-1]))

    def commit(self, seq_id: int, prompt_done: bool = False) -> None:
        """After a step: register the sequence's newly full pages under their prefix hashes. With key_channels
        (ThinK), once its prompt is done or its cache full, choose each layer's key channels and prune them."""
        seq = self.sequences[seq_id]
        if seq.channels is not None and not seq.channels.chosen and (prompt_done or self.free_slots(seq_id) <= 0):
            self._prune_key_channels(seq)
        if seq.hashable and self.prefix_caching:
            self._register(seq)
        for layer, (store, window) in enumerate(zip(self.stores, self.windows, strict=True)):
            if window:
                self._slide(seq, layer)
            store.used_peak = max(store.used_peak, store.pages.n_used())

    def _register(self, seq: SequenceCache) -> None:
        ps = self.page_size
        while (len(seq.hashes) + 1) * ps <= len(seq.token_ids):
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            h = page_hash(parent, seq.token_ids[i * ps: (i + 1) * ps])
            seq.hashes.append(h)
            for layer, (store, table) in enumerate(zip(self.stores, seq.block_tables, strict=True)):
                index = i - seq.dropped[layer]  # a local layer's table starts at its first kept page
                if index >= 0 and store.pages.register(table[index], h):
                    self._event(E.STORE, seq.seq_id, layer, table[index], detail=h)

    def _slide(self, seq: SequenceCache, layer: int, last: int | None = None) -> None:
        """Drop the pages of a local layer that the query at `last` (default: the newest written) cannot see."""
        window, store, ps = self.windows[layer], self.stores[layer], self.page_size
        last = seq.newest if last is None else last
        if not window or last < 0:
            return
        table = seq.block_tables[layer]
        if not table:
            return
        newest_of = store.positions.reshape(-1, ps)[table].max(axis=1)  # each page's newest token (-1: empty)
        gone = (newest_of >= 0) & (newest_of < first_visible(last, window))
        for page, newest in zip(np.asarray(table)[gone].tolist(), newest_of[gone].tolist(), strict=True):
            slots = slice(page * ps, (page + 1) * ps)
            table.remove(page)
            seq.holes[layer].difference_update(range(page * ps, (page + 1) * ps))
            seq.resident[layer] -= int(store.fill[page])
            if seq.head_keep[layer] is not None:
                seq.head_keep[layer][:, slots] = False
            seq.slid[layer] = max(seq.slid[layer], newest)
            if seq.hashable:
                seq.dropped[layer] += 1
            self._event(E.SLIDE, seq.seq_id, layer, page, position=newest, reason=f"slid out of the window ({window})",
                        detail=int(store.fill[page]))
            if store.release(page):
                self._event(E.RELEASE, seq.seq_id, layer, page)

    def _free_slot(self, seq: SequenceCache, layer: int) -> int:
        """The lowest empty slot of the sequence's pages, preferring pages in RAM (allocating a page if it
        has none); a page on disk is read back into RAM, a shared page is copied first."""
        store, holes, ps = self.stores[layer], seq.holes[layer], self.page_size
        if not holes:
            page, old_hash = store.allocate(self.step)
            if old_hash is not None:
                self._event(E.UNCACHE, seq.seq_id, layer, page, detail=old_hash)
            seq.block_tables[layer].append(page)
            holes.update(range(page * ps, (page + 1) * ps))
            self._event(E.ALLOCATE, seq.seq_id, layer, page, frame=int(store.frame_of[page]) if store.tiered else -1)
        flat = min(holes)
        if store.tiered and store.frame_of[flat // ps] < 0:
            in_ram = [h for h in holes if store.frame_of[h // ps] >= 0]
            flat = min(in_ram) if in_ram else flat
            store.make_resident(flat // ps, self.step)
        page, slot = divmod(flat, ps)
        if store.pages.is_shared(page):
            page = self._copy_on_write(seq, layer, page)
        return page * ps + slot

    def _evict(self, seq: SequenceCache, layer: int) -> None:
        """The policy's victims; with compress_every N, N of them (one choice at a time), down to the budget
        minus N (or to the last token the policy may evict)."""
        policy = seq.policy
        target = seq.resident[layer] - policy.compress_every
        while True:
            view = self.view(seq.seq_id, layer)
            victims, scores = policy.choose_victims(view)
            if policy.merges:
                self._merge(seq, layer, victims, scores, *policy.merge_targets(view, victims))
            else:
                self._remove(seq, layer, victims, scores, policy.reason)
            if seq.resident[layer] <= target or not (view.occupied() & ~policy.protected(view)).any():
                return

    def _prune(self, seq: SequenceCache, layer: int) -> None:
        """A pruning policy's victims before the next token, however full the cache is."""
        victims, scores = seq.policy.choose_pruned(self.view(seq.seq_id, layer))
        if len(victims):
            self._remove(seq, layer, victims, scores, seq.policy.reason)

    def _merge(self, seq: SequenceCache, layer: int, victims: np.ndarray, scores: np.ndarray, targets: np.ndarray,
               weights: np.ndarray) -> None:
        """Evict the victims, folding each one's value into its target survivor (v <- (1 - w) v + w v_victim;
        -1: none); the eviction events name the survivor's position. Targets are found again by position
        after the removal, which may have copied their page."""
        store, ps = self.stores[layer], self.page_size
        values = store.v[:, victims // ps, victims % ps].astype(np.float64)  # (n_kv, victims, d)
        into = np.where(targets >= 0, store.positions[targets], -1)
        self._remove(seq, layer, victims, scores, seq.policy.reason, details=into.tolist())
        flat = self._flat_slots(seq.block_tables[layer])
        slot_of = dict(zip(store.positions[flat].tolist(), flat.tolist(), strict=True))
        for i, position in enumerate(into.tolist()):
            if position < 0:
                continue
            page, slot = divmod(slot_of[position], ps)
            self._forget(seq, layer, page)
            if store.pages.is_shared(page):
                page = self._copy_on_write(seq, layer, page)
                flat = self._flat_slots(seq.block_tables[layer])
                slot_of = dict(zip(store.positions[flat].tolist(), flat.tolist(), strict=True))
            merged = (1 - weights[i]) * store.v[:, page, slot].astype(np.float64) + weights[i] * values[:, i]
            store.v[:, page, slot] = merged.astype(store.v.dtype)

    def _evict_heads(self, seq: SequenceCache, layer: int) -> None:
        """A per-head policy's drops before the next token."""
        self._drop_entries(seq, layer, *seq.policy.choose_head_victims(self.view(seq.seq_id, layer)))

    def compress(self, seq_id: int, reconstructed: int, note: str) -> None:
        """A compressing policy's one-shot drops (kvzip), every layer at once, after its reconstruction pass
        fed `reconstructed` tokens (a RECONSTRUCT event, `note` its reason)."""
        self._acting = seq_id
        seq = self.sequences[seq_id]
        self._event(E.RECONSTRUCT, seq_id, policy=seq.policy.name, reason=note, detail=reconstructed)
        drops = seq.policy.compress([self.view(seq_id, layer) for layer in range(len(self.stores))])
        for layer, (heads, victims, scores) in enumerate(drops):
            self._drop_entries(seq, layer, heads, victims, scores)

    def _drop_entries(self, seq: SequenceCache, layer: int, heads: np.ndarray, victims: np.ndarray,
                      scores: np.ndarray) -> None:
        """Mask each (KV head, slot) entry named; free the slots no KV head keeps any more."""
        if not len(victims):
            return
        keep, ps = seq.head_keep[layer], self.page_size
        for head, flat, score in zip(heads.tolist(), victims.tolist(), scores.tolist(), strict=True):
            if not keep[head, flat]:
                raise RuntimeError(f"policy {seq.policy.name!r} dropped an entry KV head {head} no longer keeps")
            keep[head, flat] = False
            self._event(E.MASK, seq.seq_id, layer, *divmod(flat, ps), int(self.stores[layer].positions[flat]),
                        seq.policy.name, seq.policy.reason, float(score), detail=head)
        gone = np.unique(victims[~keep[:, victims].any(axis=0)])
        if len(gone):
            self._remove(seq, layer, gone, np.full(len(gone), np.nan), "dropped by every KV head")

    def _remove(self, seq: SequenceCache, layer: int, victims: np.ndarray, scores: np.ndarray, reason: str,
                details: list[int] | None = None) -> None:
        """Take the tokens in these flat slots out of the sequence (copying a shared page first); free
        the pages left empty. `details`: each eviction event's detail (merges: the survivor's position)."""
        store, ps = self.stores[layer], self.page_size
        seq.hashable = False
        copies: dict[int, int] = {}  # shared page -> this sequence's copy (a policy may take several slots)
        removed: list[int] = []
        for flat, score, detail in zip(victims.tolist(), scores.tolist(), details or [-1] * len(victims),
                                       strict=True):
            page, slot = divmod(flat, ps)
            page = copies.get(page, page)
            if store.pages.is_shared(page):
                copies[page] = page = self._copy_on_write(seq, layer, page)
            self._forget(seq, layer, page)
            position = store.remove(page * ps + slot)
            removed.append(position)
            seq.holes[layer].add(page * ps + slot)
            seq.resident[layer] -= 1
            if seq.head_keep[layer] is not None:
                seq.head_keep[layer][:, page * ps + slot] = False
            self._event(E.EVICT, seq.seq_id, layer, page, slot, position, seq.policy.name, reason, float(score),
                        detail=detail)
            if store.fill[page] == 0:
                seq.block_tables[layer].remove(page)
                seq.holes[layer].difference_update(range(page * ps, (page + 1) * ps))
                store.release(page)
                self._event(E.RELEASE, seq.seq_id, layer, page)
        if seq.policy.rerotate:
            self._rerotate(seq, layer, removed)

    def _rerotate(self, seq: SequenceCache, layer: int, removed: list[int]) -> None:
        """After the tokens at positions `removed` left: each survivor older than k of them moves k positions
        later (its key rotated by k; kvcache/rope_shift.py), so that the distance from any query to it is
        the one contiguous positions would give. A page it changes is copied first if shared, and no longer
        stands for its prefix hash."""
        store, ps = self.stores[layer], self.page_size
        flat = self._flat_slots(seq.block_tables[layer])
        positions = store.positions[flat]
        later = len(removed) - np.searchsorted(np.sort(removed), positions, side="right")
        moving = (positions >= 0) & (later > 0)
        moved, delta = flat[moving], later[moving]
        for page in np.unique(moved // ps).tolist():
            self._forget(seq, layer, page)
            if store.pages.is_shared(page):
                copy = self._copy_on_write(seq, layer, page)
                moved = np.where(moved // ps == page, copy * ps + moved % ps, moved)
        pages, slots = moved // ps, moved % ps
        rotated = rotate(store.k[:, pages, slots], delta, self.inv_freq).astype(store.k.dtype)
        if seq.channels is not None:  # ThinK: a RoPE pair with one channel pruned keeps that channel zero
            rotated = seq.channels.prune(layer, rotated.transpose(1, 0, 2)).transpose(1, 0, 2)
        store.k[:, pages, slots] = rotated

    def _prune_key_channels(self, seq: SequenceCache) -> None:
        """ThinK: each layer's key channels chosen from its query window and the keys the sequence holds, and
        the pruned ones zeroed in those keys (a shared page is copied first and keeps its prefix hash; a page
        changed in place leaves the prefix cache; the sequence registers no more pages: they no longer hold the
        prefix's plain keys)."""
        ps = self.page_size
        seq.hashable = False
        for layer, store in enumerate(self.stores):
            for page in list(seq.block_tables[layer]):
                if store.pages.is_shared(page):
                    self._copy_on_write(seq, layer, page)
                else:
                    self._forget(seq, layer, page)
            flat = self._flat_slots(seq.block_tables[layer])
            flat = flat[store.positions[flat] >= 0]
            pages, slots = flat // ps, flat % ps
            kept = seq.channels.choose(layer, store.k[:, pages, slots])
            store.k[:, pages, slots] *= kept[:, None, :].astype(store.k.dtype)

    def _forget(self, seq: SequenceCache, layer: int, page: int) -> None:
        """The page's contents change: it no longer stands for its prefix hash."""
        old_hash = self.stores[layer].pages.forget(page)
        if old_hash is not None:
            self._event(E.UNCACHE, seq.seq_id, layer, page, detail=old_hash)

    def _copy_on_write(self, seq: SequenceCache, layer: int, page: int) -> int:
        ps = self.page_size
        keep = self.stores[layer].positions[page * ps: (page + 1) * ps] >= 0
        self.cow_total += 1
        return self._copy_page(seq, layer, page, keep, replace=True)

    def _copy_page(self, seq: SequenceCache, layer: int, page: int, keep: np.ndarray, replace: bool = False) -> int:
        """Copy the `keep` slots of page into a new page of seq (replacing page in its table, or appended)."""
        store, ps = self.stores[layer], self.page_size
        if not store.pages.can_allocate():
            raise CacheFullError(f"the pool's {self.pool_pages} pages of layer {layer} are all in use "
                                 f"(sequence {seq.seq_id} must copy page {page} before writing to it)")
        new, old_hash = store.allocate(self.step)
        if old_hash is not None:
            self._event(E.UNCACHE, seq.seq_id, layer, new, detail=old_hash)
        store.copy_page(page, new, keep)
        src, dst = slice(page * ps, (page + 1) * ps), slice(new * ps, (new + 1) * ps)
        for array in seq.states[layer].arrays.values():
            array[dst] = np.where(keep.reshape(-1, *(1,) * (array.ndim - 1)), array[src], 0)
        if seq.head_keep[layer] is not None:
            seq.head_keep[layer][:, dst] = seq.head_keep[layer][:, src] & keep
        table, holes = seq.block_tables[layer], seq.holes[layer]
        empty = (new * ps + np.flatnonzero(~keep)).tolist()
        if replace:
            if seq.head_keep[layer] is not None:
                seq.head_keep[layer][:, src] = False  # the page stays another sequence's, not this one's
            table[table.index(page)] = new
            holes.difference_update(range(page * ps, (page + 1) * ps))
            store.release(page)
        else:
            table.append(new)
            seq.resident[layer] += int(keep.sum())
        holes.update(empty)
        self._event(E.COPY_ON_WRITE, seq.seq_id, layer, new, detail=page)
        return new

    def _event(self, kind: EventKind, seq: int, layer: int = -1, page: int = -1, slot: int = -1,
               position: int = -1, policy: str = "", reason: str = "", score: float = float("nan"),
               frame: int = -1, detail: int = -1) -> None:
        self.events.append(CacheEvent(kind, self.step, layer, page, slot, position, policy, reason, score, frame,
                                      seq, detail))

    def _move_event(self, layer: int):
        def moved(kind: EventKind, page: int, frame: int, detail: str) -> None:
            self._event(kind, self._acting, layer, page, reason=detail, frame=frame)
        return moved

    # --- quantized storage (int4 / int2: KIVI's residual window) ------------------------------------
    def _seal_residual(self, seq: SequenceCache, layer: int, n_new: int) -> None:
        """Before n_new tokens are written: while the sequence's full-precision tokens would then exceed
        residual + group - 1, quantize the oldest `group` (32) of them (written in earlier calls) as one
        key group. A prefill chunk is attended in full precision; in decoding the newest `residual` tokens
        stay float32 and the oldest 32 beyond them are quantized once they have all arrived (KIVI). A
        shared page is copied first: the change is this sequence's alone."""
        store, ps = self.stores[layer], self.page_size
        group, limit = store.layout.group, store.layout.residual + store.layout.group - 1
        window = store.residual_slots(self._flat_slots(seq.block_tables[layer]))
        while len(window) >= group and len(window) + n_new > limit:
            oldest = window[np.argsort(store.positions[window], kind="stable")[:group]]
            for page in np.unique(oldest // ps).tolist():
                if store.pages.is_shared(page):
                    copy = self._copy_on_write(seq, layer, page)
                    oldest = np.where(oldest // ps == page, copy * ps + oldest % ps, oldest)
            store.seal(oldest, self.step)
            window = store.residual_slots(self._flat_slots(seq.block_tables[layer]))

    def _whole_key_groups(self, hit: list) -> list:
        """A prefix hit (pages per layer) cut back until no key group of its pages reaches a token past it:
        a page's int4 / int2 key codes depend on every token of their group."""
        while hit and any(store.group_reach([pages[layer] for _, pages in hit]) >= len(hit) * self.page_size
                          for layer, store in enumerate(self.stores)):
            hit.pop()
        return hit

    # --- attention -------------------------------------------------------------------------------
    def attend(self, seq_id: int, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention of the sequence's n queries (n, n_heads, head_dim) at `positions` over its resident
        tokens. Weights come back over flat slots: the pool's allocated prefix when `slots` is None (a
        single sequence in RAM), else over `result.slots`; exactly 0 on empty slots."""
        self._acting = seq_id
        seq, store = self.sequences[seq_id], self.stores[layer]
        if store.tiered or store.quantized or (self.select_pages is not None and len(q) == 1):
            return self._read(seq, layer, q, positions)
        seq.read_slots[layer] = None
        self._observe_queries(seq, layer, q, positions)
        n_kv, _, ps, head_dim = store.k.shape
        keep = seq.head_keep[layer]
        # a local layer's window may sit far above the pool's bottom (slid-out pages stay cached below it):
        # gathering its few pages beats reading the whole used prefix
        in_place = len(self.sequences) == 1 and not (self.windows[layer] and
                                                     2 * len(seq.block_tables[layer]) < store.high_water)
        if in_place:  # the only owner: the pool's used prefix, in place
            n_slots = store.high_water * ps
            keys = store.k[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
            values = store.v[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
            # With no empty slot below the high-water mark the occupancy mask is all zeros: skip it.
            bias = None if seq.resident[layer] == n_slots else store.bias[:n_slots]
            read: slice | np.ndarray = slice(0, n_slots)
            result = attend_kept(q, keys, values, bias, store.positions[:n_slots], positions,
                                 None if keep is None else keep[:, read], self.windows[layer])
        else:  # gathered through its block table
            table = seq.block_tables[layer]
            keys = store.k[:, table].reshape(n_kv, len(table) * ps, head_dim)
            values = store.v[:, table].reshape(n_kv, len(table) * ps, head_dim)
            read = self._flat_slots(table)
            bias = store.bias[read]
            result = attend_kept(q, keys, values, bias if bias.any() else None, store.positions[read], positions,
                                 None if keep is None else keep[:, read], self.windows[layer])
            result = result._replace(slots=read)
        if seq.policy.uses_attention:
            seq.states[layer].observe(result.weights, read)
        return result

    @staticmethod
    def _observe_queries(seq: SequenceCache, layer: int, q: np.ndarray, positions: np.ndarray) -> None:
        """The queries a layer attends with, to the policy that reads them and to ThinK's window."""
        if seq.policy.uses_queries:
            seq.states[layer].query(q, positions)
        if seq.channels is not None:
            seq.channels.observe(layer, q)

    def attend_beside(self, seq_id: int, layer: int, q: np.ndarray, positions: np.ndarray, k: np.ndarray,
                      v: np.ndarray, own_positions: np.ndarray) -> AttentionResult:
        """Attention of queries whose tokens are not cached (kvzip's reconstruction pass) over the sequence's
        resident tokens and the given ones (k, v: (m, n_kv_heads, head_dim) at own_positions, seen causally);
        nothing is written, and the policy's statistics see the weights on the cached tokens only through
        `reconstruct`. Weights over the read slots, then the given tokens; result.slots: the read slots. RAM
        pages of float K/V only."""
        seq, store = self.sequences[seq_id], self.stores[layer]
        table = seq.block_tables[layer]
        n_kv, _, ps, head_dim = store.k.shape
        read = self._flat_slots(table)
        keys = np.concatenate([store.k[:, table].reshape(n_kv, len(read), head_dim), k.transpose(1, 0, 2)], axis=1)
        values = np.concatenate([store.v[:, table].reshape(n_kv, len(read), head_dim), v.transpose(1, 0, 2)],
                                axis=1)
        bias = np.concatenate([store.bias[read], np.zeros(len(own_positions), dtype=np.float32)])
        keep = seq.head_keep[layer]
        if keep is not None:
            keep = np.concatenate([keep[:, read], np.ones((n_kv, len(own_positions)), dtype=bool)], axis=1)
        result = attend_kept(q, keys, values, bias, np.concatenate([store.positions[read], own_positions]),
                             positions, keep, self.windows[layer])
        seq.states[layer].reconstruct(result.weights[..., : len(read)], read)
        return result._replace(slots=read)

    def can_attend_many(self, seq_ids: list[int], layer: int) -> bool:
        """Whether `attend_many` serves these sequences: several of them in a shared pool, pages in RAM and
        unquantized, no page selection, no per-head residency."""
        store = self.stores[layer]
        return (len(seq_ids) > 1 and len(self.sequences) > 1 and not (store.tiered or store.quantized)
                and self.select_pages is None
                and all(self.sequences[seq_id].head_keep[layer] is None for seq_id in seq_ids))

    def attend_many(self, seq_ids: list[int], layer: int, q: np.ndarray, positions: np.ndarray
                    ) -> list[AttentionResult]:
        """`attend` for several sequences that each decode one token (q: (B, n_heads, d), positions (B,)),
        in one batched kernel over their block tables, padded to the longest. Only where `can_attend_many`."""
        store = self.stores[layer]
        seqs = [self.sequences[seq_id] for seq_id in seq_ids]
        tables = [seq.block_tables[layer] for seq in seqs]
        widest = max(len(table) for table in tables)
        padded = np.zeros((len(seqs), widest), dtype=np.int64)
        for row, table in zip(padded, tables, strict=True):
            row[: len(table)] = table
        ps = self.page_size
        flat = (padded[:, :, None] * ps + np.arange(ps)).reshape(len(seqs), widest * ps)
        bias = store.bias[flat]
        lengths = np.array([len(table) for table in tables]) * ps
        bias[np.arange(widest * ps)[None, :] >= lengths[:, None]] = -np.inf  # the padding
        if self.windows[layer]:
            bias[store.positions[flat] <= positions[:, None] - self.windows[layer]] = -np.inf
        n_kv, _, _, head_dim = store.k.shape
        keys = store.k[:, padded].reshape(n_kv, len(seqs), widest * ps, head_dim)
        values = store.v[:, padded].reshape(n_kv, len(seqs), widest * ps, head_dim)
        for i, seq in enumerate(seqs):
            seq.read_slots[layer] = None
            self._observe_queries(seq, layer, q[i: i + 1], positions[i: i + 1])
        output, weights = attend_decode_batch(q, keys, values, bias)
        results = []
        for i, seq in enumerate(seqs):
            n = lengths[i]
            result = AttentionResult(output[i: i + 1], weights[i: i + 1, :, :n], flat[i, :n])
            if seq.policy.uses_attention:
                seq.states[layer].observe(result.weights, result.slots)
            results.append(result)
        return results

    def _read(self, seq: SequenceCache, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention through the reader: pages on disk, or a page selection (a chunk of several
        queries reads every page: max_chunk keeps such chunks within select_pages pages)."""
        select = self.select_pages if len(q) == 1 else None
        self._observe_queries(seq, layer, q, positions)
        result = read_attention(self.stores[layer], seq.block_tables[layer], q, positions, self.step, select,
                                all_weights=seq.policy.uses_attention and len(q) > 1,
                                own_pages_only=len(self.sequences) > 1, keep=seq.head_keep[layer],
                                window=self.windows[layer])
        seq.read_slots[layer] = result.slots
        if seq.policy.uses_attention:
            seq.states[layer].observe(result.weights, result.slots)
        return result


def attend_kept(q: np.ndarray, keys: np.ndarray, values: np.ndarray, bias: np.ndarray | None,
                key_positions: np.ndarray, positions: np.ndarray, keep: np.ndarray | None,
                window: int | None = None) -> AttentionResult:
    """`attend`, where KV head h reads only the keys with keep[h] (per-head residency; None: all keys for
    every head). When some head dropped a resident token, each KV head's queries attend alone with that
    head's mask added to the occupancy bias (-inf on dropped entries); the heads' results are joined in
    query-head order."""
    if keep is None or (keep.all(axis=0) | ~keep.any(axis=0)).all():  # no head differs: one call
        return attend(q, keys, values, bias, key_positions, positions, window)
    n_kv = keys.shape[0]
    group = q.shape[1] // n_kv
    outputs, weights = [], []
    for head in range(n_kv):
        head_bias = np.where(keep[head], np.float32(0), np.float32(-np.inf))
        if bias is not None:
            head_bias += bias
        part = attend(q[:, head * group: (head + 1) * group], keys[head: head + 1], values[head: head + 1],
                      head_bias, key_positions, positions, window)
        outputs.append(part.output)
        weights.append(part.weights)
    return AttentionResult(np.concatenate(outputs, axis=1), np.concatenate(weights, axis=1))

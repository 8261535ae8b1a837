"""One manager per layer, chosen by the layer's spec (vLLM v1's `single_type_kv_cache_manager.py`): the layer's
pages under every sequence's block table.

`LayerManager` owns every sequence's table in its layer (`tables`: seq_id -> LayerTable, sequence.py; vLLM's
`req_to_blocks`): nothing else changes a block table, its holes, its resident count or per-head masks, and
besides attention (paged_attention.py: the weights it feeds the policy's statistics, the slots it read) nothing
changes its policy statistics. It holds what every kind of layer does with its pages: share one, take an empty slot (allocating,
reading a disk page back, copying a shared page first: copy-on-write, through the one door `writable`), copy,
release, register a full page under its prefix hash; and what a policy's choice does there (eviction.py asks):
`evict` tokens, `drop_entries` of per-head masks, and through its `rewrites` part (rewrites.py) the in-place
changes to survivors (merged values, re-rotated keys, ThinK's key channels, KIVI's sealed key groups). The two
kinds differ only where they hold different tokens:

- `FullAttentionManager` (a global layer) keeps every token until a policy evicts it: its block tables only grow
  (or leave holes), its prefix hit is every cached page from the first on.
- `SlidingWindowManager` (a local layer, layer_spec.py) drops each page none of whose tokens the sequence's newest
  query sees (`slide`: a SLIDE event, then a release if no other sequence uses it), before each write and after
  each step; its attention masks keys beyond the window; a policy's budget applies only when it is smaller
  than the window; its prefix hit needs only the pages of the last window, found right to left, and its block
  table then starts at logical page `dropped`.

The coordinator (kv_cache_manager.py) asks each layer's manager and never branches on the kind: a new kind of
layer is a new spec and a new manager in `MANAGERS`.
"""

from __future__ import annotations

import copy

import numpy as np

from pagevis.kvcache.errors import CacheFullError, ConfigError
from pagevis.kvcache.events import EventKind, EventLog
from pagevis.kvcache.policy_state import LayerView, PolicyState
from pagevis.kvcache.rewrites import Rewrites
from pagevis.kvcache.sequence import LayerTable, SequenceCache
from pagevis.kvcache.slots import flat_slots, page_slots
from pagevis.kvcache.layer_spec import FullAttentionSpec, LayerSpec, SlidingWindowSpec, first_kept_page, first_visible
from pagevis.kvcache.store import PageStore, note_peak

E = EventKind


class LayerManager:
    """One layer's pages for any number of sequences (their tables are per layer: policies evict per layer)."""

    def __init__(self, spec: LayerSpec, store: PageStore, log: EventLog, pool_pages: int):
        self.window = spec.window  # the keys a query sees: all (None), or the last `window` positions
        self.store, self.log = store, log
        self.layer, self.page_size, self.pool_pages = store.layer, store.page_size, pool_pages
        self.tables: dict[int, LayerTable] = {}  # seq_id -> its share of this layer (vLLM's req_to_blocks)
        self.copies = 0  # copy-on-write copies made
        self.rewrites = Rewrites(self)  # its in-place changes to surviving tokens (merges, re-rotation, ThinK, KIVI)
        store.tier.on_move = self._moved

    # --- its sequences' tables ---------------------------------------------------------------------
    def add(self, seq: SequenceCache) -> LayerTable:
        """A new sequence's empty table here (its policy's statistics; per-head masks if it evicts per head)."""
        store = self.store
        keep = np.zeros((store.n_kv, store.n_slots), dtype=bool) if seq.policy.per_head else None
        table = self.tables[seq.seq_id] = LayerTable(seq.policy.make_state(store.n_slots), keep)
        return table

    def clear(self) -> None:
        """Every sequence's table empty (the cache's reset: the sequences stay)."""
        for table in self.tables.values():
            table.clear()

    def table(self, seq: SequenceCache) -> LayerTable:
        """The sequence's share of this layer (live: it changes with the next step)."""
        return self.tables[seq.seq_id]

    def event(self, kind: EventKind, seq: SequenceCache, *args, **kwargs) -> None:
        self.log.add(kind, seq.seq_id, self.layer, *args, **kwargs)

    def _moved(self, kind: EventKind, page: int, frame: int, detail: str) -> None:
        self.log.add(kind, self.log.acting, self.layer, page, reason=detail, frame=frame)

    # --- questions -------------------------------------------------------------------------------
    def flat(self, seq: SequenceCache) -> np.ndarray:
        """The flat slots of the sequence's pages, in logical order."""
        return flat_slots(self.tables[seq.seq_id].pages, self.page_size)

    def budget(self, seq: SequenceCache) -> int:
        """Tokens the layer may hold before the sequence's policy evicts there."""
        return seq.policy.layer_capacity(self.layer)

    def view(self, seq: SequenceCache) -> LayerView:
        """What the sequence's policy reads: positions of its own slots (the live store array when it is
        the only sequence; a masked copy otherwise)."""
        table, positions = self.tables[seq.seq_id], self.store.positions
        if len(self.tables) > 1:
            flat = flat_slots(table.pages, self.page_size)
            positions = np.full(self.store.n_slots, -1, dtype=np.int64)
            positions[flat] = self.store.positions[flat]
        return LayerView(self.layer, self.page_size, positions, table.pages, table.state, table.head_keep)

    def head_entries(self, seq: SequenceCache) -> int:
        """(KV head, token) entries the sequence holds here (n_kv_heads per resident token for a token policy)."""
        table = self.tables[seq.seq_id]
        keep = table.head_keep
        if keep is None:
            return table.resident * self.store.n_kv
        flat = self.flat(seq)
        return int((keep[:, flat] & (self.store.positions[flat] >= 0)).sum())

    # --- what the kinds of layer do differently --------------------------------------------------
    def before_write(self, seq: SequenceCache, first: int) -> None:
        """Tokens from position `first` on are about to be written."""

    def after_step(self, seq: SequenceCache) -> None:
        """A step wrote the sequence's tokens."""

    def attended(self, seq: SequenceCache, last: int) -> None:
        """A chunk of the sequence's queries up to position `last` has attended here (the commit comes later)."""

    def longest_hit(self, hashes: list[int], n: int) -> int:
        """The most of the first n full pages of a prompt (their prefix hashes) a prefix hit may reuse here."""
        raise NotImplementedError

    def hit_pages(self, hashes: list[int]) -> list[int | None]:
        """Per full page of a prefix hit, the cached page this layer reuses (None: a page it does not need)."""
        raise NotImplementedError

    def after_hit(self, seq: SequenceCache, n_tokens: int) -> None:
        """A prefix hit gave the sequence its first n_tokens."""

    def check_fork(self, parent: SequenceCache, n: int) -> None:
        """ConfigError when a child of the parent's first n tokens cannot be made here."""

    def gathers(self, seq: SequenceCache) -> bool:
        """Whether a sole sequence's attention gathers its pages rather than reading the used prefix in place: when
        the prefix is over twice its pages (a pool aged by cached pages: docs/serving.md, issue 43)."""
        return 2 * len(self.tables[seq.seq_id].pages) < self.store.high_water

    def mask(self, bias: np.ndarray, key_positions: np.ndarray, positions: np.ndarray) -> None:
        """Add -inf to `bias` (queries x keys) where a query at `positions` must not see a key here."""

    # --- pages -----------------------------------------------------------------------------------
    def share(self, seq: SequenceCache, page: int, first_position: int | None = None) -> None:
        """One more table entry of seq points at page (in use, or a cached free page, restored)."""
        store, ps = self.store, self.page_size
        was_free = store.pages.ref_counts[page] == 0
        store.pages.share(page)
        if was_free:  # a cached free page comes back: only a prefix hit takes one (a fork shares live pages)
            assert first_position is not None
            store.restore(page, first_position)
        table = self.tables[seq.seq_id]
        table.pages.append(page)
        table.floor = -1
        table.resident += int(store.fill[page])
        held = store.positions[page_slots(page, ps)] >= 0
        table.holes.update((page * ps + np.flatnonzero(~held)).tolist())
        keep = table.head_keep
        if keep is not None and first_position is not None:  # a prefix hit: all heads keep it
            keep[:, page_slots(page, ps)] = held  # (a fork keeps its parent's masks)
        self.event(E.SHARE, seq, page, detail=int(store.pages.ref_counts[page]))

    def release(self, seq: SequenceCache, page: int) -> None:
        """Drop one of the sequence's references to the page (a RELEASE event if it became free)."""
        if self.store.release(page):
            self.event(E.RELEASE, seq, page)

    def free(self, seq: SequenceCache) -> None:
        """Release the sequence's pages, last first (so a cached prefix outlives its tail); its table goes."""
        for page in reversed(self.tables.pop(seq.seq_id).pages):
            self.release(seq, page)

    def fork(self, parent: SequenceCache, child: SequenceCache, n: int) -> None:
        """The child shares each parent page whose tokens all come before n; a page holding later tokens too is
        copied with those masked out. The child's table starts with copies of the parent's statistics, per-head
        masks and slide."""
        store, ps, own = self.store, self.page_size, self.tables[parent.seq_id]
        self.tables[child.seq_id] = LayerTable(copy.deepcopy(own.state),
                                               None if own.head_keep is None else own.head_keep.copy(),
                                               dropped=own.dropped, slid=own.slid)
        for page in own.pages:
            positions = store.positions[page_slots(page, ps)]
            keep = (positions >= 0) & (positions < n)
            if not keep.any():
                continue
            if keep.sum() == store.fill[page]:
                self.share(child, page)
            else:
                self.copy_page(child, page, keep)
        self.after_step(child)

    def register(self, seq: SequenceCache, index: int, page_hash: int) -> None:
        """The sequence's logical page `index` is full: register it under its prefix hash (if this layer holds it)."""
        index -= self.tables[seq.seq_id].dropped  # a local layer's table starts at its first kept page
        table = self.tables[seq.seq_id].pages
        if index >= 0 and self.store.pages.register(table[index], page_hash):
            self.event(E.STORE, seq, table[index], detail=page_hash)

    def commit(self, seq: SequenceCache) -> None:
        """After a step: the layer's own bookkeeping, and the pool's peak."""
        self.after_step(seq)
        note_peak(self.store)

    def writable(self, seq: SequenceCache, page: int, keeps_prefix: bool = False) -> int:
        """The page the sequence is about to change (copy-on-write, for every change): a copy of its own when
        another sequence shares the page — which keeps its K/V and its prefix hash, unchanged — else the page
        itself, which then no longer stands for its prefix hash (unless the change `keeps_prefix`: KIVI's
        sealing quantizes the tokens as every sequence with this prefix does)."""
        pages = self.store.pages
        if pages.ref_counts[page] > 1:  # shared (BlockPool.is_shared)
            return self._copy_on_write(seq, page)
        if not keeps_prefix and page in pages.frame_hash:
            self._forget(seq, page)
        return page

    def _forget(self, seq: SequenceCache, page: int) -> None:
        """The page's contents change: it no longer stands for its prefix hash."""
        old_hash = self.store.pages.forget(page)
        if old_hash is not None:
            self.event(E.UNCACHE, seq, page, detail=old_hash)

    def _copy_on_write(self, seq: SequenceCache, page: int) -> int:
        keep = self.store.positions[page_slots(page, self.page_size)] >= 0
        self.copies += 1
        return self.copy_page(seq, page, keep, replace=True)

    def copy_page(self, seq: SequenceCache, page: int, keep: np.ndarray, replace: bool = False) -> int:
        """Copy the `keep` slots of page into a new page of seq (replacing page in its table, or appended)."""
        store, ps, layer = self.store, self.page_size, self.layer
        if not store.pages.can_allocate():
            raise CacheFullError(f"the pool's {self.pool_pages} pages of layer {layer} are all in use "
                                 f"(sequence {seq.seq_id} must copy page {page} before writing to it)")
        new, old_hash = store.allocate(self.log.step)
        if old_hash is not None:
            self.event(E.UNCACHE, seq, new, detail=old_hash)
        store.copy_page(page, new, keep)
        src, dst = page_slots(page, ps), page_slots(new, ps)
        own = self.tables[seq.seq_id]
        for array in own.state.arrays.values():
            array[dst] = np.where(keep.reshape(-1, *(1,) * (array.ndim - 1)), array[src], 0)
        head_keep = own.head_keep
        if head_keep is not None:
            head_keep[:, dst] = head_keep[:, src] & keep
        table, holes = own.pages, own.holes
        own.floor = -1
        empty = (new * ps + np.flatnonzero(~keep)).tolist()
        if replace:
            if head_keep is not None:
                head_keep[:, src] = False  # the page stays another sequence's, not this one's
            table[table.index(page)] = new
            holes.difference_update(range(page * ps, (page + 1) * ps))
            store.release(page)
        else:
            table.append(new)
            own.resident += int(keep.sum())
        holes.update(empty)
        self.event(E.COPY_ON_WRITE, seq, new, detail=page)
        return new

    # --- one token in, one token out ------------------------------------------------------------------
    def write(self, seq: SequenceCache, k: np.ndarray, v: np.ndarray, position: int) -> None:
        """The token at `position` (its key and value (n_kv_heads, head_dim)) into the sequence's lowest empty
        slot (free_slot: a page allocated, read back from disk or copied first as needed)."""
        table = self.tables[seq.seq_id]
        flat = self.free_slot(seq, table)
        self.store.write(flat, k, v, position)
        self.wrote(seq, table, flat, k, v, position)

    def wrote(self, seq: SequenceCache, table: LayerTable, flat: int, k: np.ndarray, v: np.ndarray,
              position: int) -> None:
        """The sequence's table, its policy's statistics and the event log after its token went into slot flat
        (`write`, or the decode kernel that writes and attends: paged_attention.write_and_attend)."""
        table.holes.remove(flat)
        table.resident += 1
        if position < table.floor:
            table.floor = -1
        state = table.state
        if type(state) is not PolicyState:  # (the base keeps no statistics)
            state.took(flat, k, v, position)
        if table.head_keep is not None:
            table.head_keep[:, flat] = True
        page, slot = divmod(flat, self.page_size)
        self.log.add_write(seq.seq_id, self.layer, page, slot, position)

    def take_out(self, seq: SequenceCache, flat: int, reason: str, score: float, detail: int = -1) -> int:
        """Evict the token in the sequence's slot `flat` (of a page `writable` gave) and release its page if
        that left it empty; returns the token's position. reason, score, detail: its EVICT event's."""
        store, ps, table = self.store, self.page_size, self.tables[seq.seq_id]
        page, slot = divmod(flat, ps)
        position = store.remove(flat)
        table.floor = -1
        table.holes.add(flat)
        table.resident -= 1
        keep = table.head_keep
        if keep is not None:
            keep[:, flat] = False
        self.event(E.EVICT, seq, page, slot, position, seq.policy.name, reason, score, detail=detail)
        if store.fill[page] == 0:
            table.pages.remove(page)
            table.holes.difference_update(range(page * ps, (page + 1) * ps))
            store.release(page)
            self.event(E.RELEASE, seq, page)
        return position

    # --- writing ---------------------------------------------------------------------------------
    def free_slot(self, seq: SequenceCache, table: LayerTable) -> int:
        """The lowest empty slot of the sequence's pages (`table`: its table here), preferring pages in RAM
        (allocating a page if it has none); a page on disk is read back into RAM, a shared page is copied first."""
        store, ps, step, holes = self.store, self.page_size, self.log.step, table.holes
        if not holes:
            page, old_hash = store.allocate(step)
            if old_hash is not None:
                self.event(E.UNCACHE, seq, page, detail=old_hash)
            table.pages.append(page)
            table.floor = -1
            holes.update(range(page * ps, (page + 1) * ps))
            self.event(E.ALLOCATE, seq, page, frame=int(store.frame_of[page]) if store.tiered else -1)
            return page * ps  # its first slot: in RAM, unshared, standing for no prefix hash (`writable`'s page)
        flat = min(holes)
        if store.tiered and store.frame_of[flat // ps] < 0:
            in_ram = [h for h in holes if store.frame_of[h // ps] >= 0]
            flat = min(in_ram) if in_ram else flat
            store.make_resident(flat // ps, step)
        page, slot = divmod(flat, ps)
        return self.writable(seq, page) * ps + slot

    # --- what a policy's choice does here (eviction.py asks; every changed page comes from `writable`) -----
    def evict(self, seq: SequenceCache, victims: np.ndarray, scores: np.ndarray, reason: str,
              details: list[int] | None = None) -> list[int]:
        """Take the tokens in these flat slots out of the sequence (copying a shared page first) and free the
        pages left empty; returns their positions. `details`: each EVICT event's (merges: the survivor's
        position). The sequence's pages no longer hold whole prefixes: it registers no more."""
        ps = self.page_size
        seq.hashable = False
        copies: dict[int, int] = {}  # shared page -> this sequence's copy (a policy may take several slots)
        removed: list[int] = []
        for flat, score, detail in zip(victims.tolist(), scores.tolist(), details or [-1] * len(victims),
                                       strict=True):
            page, slot = divmod(flat, ps)
            if page not in copies:
                copies[page] = self.writable(seq, page)
            removed.append(self.take_out(seq, copies[page] * ps + slot, reason, float(score), detail))
        return removed

    def drop_entries(self, seq: SequenceCache, heads: np.ndarray, victims: np.ndarray,
                     scores: np.ndarray) -> np.ndarray:
        """Mask each (KV head, slot) entry named out of the sequence's per-head masks (a MASK event each; masks
        are the sequence's, so a shared page is not copied); returns the slots no KV head keeps now."""
        keep, ps, policy = self.tables[seq.seq_id].head_keep, self.page_size, seq.policy
        assert keep is not None  # only a per-head policy drops entries, and its sequence keeps masks
        add, name, reason, seq_id, layer = self.log.add, policy.name, policy.reason, seq.seq_id, self.layer
        for head, flat, position, score in zip(heads.tolist(), victims.tolist(), self.store.positions[victims].tolist(),
                                               scores.tolist(), strict=True):
            if not keep[head, flat]:
                raise RuntimeError(f"policy {policy.name!r} dropped an entry KV head {head} no longer keeps")
            keep[head, flat] = False
            add(E.MASK, seq_id, layer, flat // ps, flat % ps, position, name, reason, score, -1, head)
        gone = victims[~keep[:, victims].any(axis=0)]
        return np.unique(gone) if len(gone) > 1 else gone

    def positions_at(self, flats: np.ndarray) -> np.ndarray:
        """The token positions in these flat slots (-1: empty)."""
        return self.store.positions[flats]

    def values_at(self, flats: np.ndarray) -> np.ndarray:
        """The values in these flat slots, (n_kv, len(flats), head_dim) float64 (a merge's victims)."""
        return self.store.v[:, flats // self.page_size, flats % self.page_size].astype(np.float64)


class FullAttentionManager(LayerManager):
    """A global layer: every token stays until a policy evicts it."""

    def longest_hit(self, hashes, n):
        pages = []
        for h in hashes[:n]:
            page = self.store.pages.lookup(h)
            if page is None:
                break
            pages.append(page)
        n = len(pages)  # int4 / int2: no key group of the hit's pages may reach a token past it
        while n and self.store.group_reach(pages[:n]) >= n * self.page_size:
            n -= 1
        return n

    def hit_pages(self, hashes):
        return [self.store.pages.lookup(h) for h in hashes]


class SlidingWindowManager(LayerManager):
    """A local layer: the last `window` positions (layer_spec.py)."""

    window: int  # a sliding window's spec always has one

    def budget(self, seq):
        """The policy's budget under the window; else the window alone bounds the layer (the policy never runs)."""
        budget = seq.policy.layer_capacity(self.layer)
        return budget if budget < self.window else max(budget, self.pool_pages * self.page_size)

    def before_write(self, seq, first):
        self.slide(seq, first - 1)

    def after_step(self, seq):
        self.slide(seq)

    def attended(self, seq, last):
        """A long chunk's pages below the window leave now, unregistered, but for the one a hit of this prompt reads."""
        self.slide(seq, last - self.page_size)

    def slide(self, seq: SequenceCache, last: int | None = None) -> None:
        """Drop the pages that the query at `last` (default: the newest written) cannot see."""
        store, ps, own = self.store, self.page_size, self.tables[seq.seq_id]
        last = seq.newest if last is None else last
        table, first = own.pages, first_visible(last, self.window)
        if last < 0 or not table or first <= own.floor:  # (no page's newest token is below the window)
            return
        newest_of = store.positions.reshape(-1, ps)[table].max(axis=1)  # each page's newest token (-1: empty)
        gone = (newest_of >= 0) & (newest_of < first)
        held = newest_of[~gone & (newest_of >= 0)]
        own.floor = int(held.min()) if len(held) else -1
        for page, newest in zip(np.asarray(table)[gone].tolist(), newest_of[gone].tolist(), strict=True):
            table.remove(page)
            own.holes.difference_update(range(page * ps, (page + 1) * ps))
            own.resident -= int(store.fill[page])
            if own.head_keep is not None:
                own.head_keep[:, page_slots(page, ps)] = False
            own.slid = max(own.slid, newest)
            own.dropped += int(seq.hashable)
            self.event(E.SLIDE, seq, page, position=newest, reason=f"slid out of the window ({self.window})",
                       detail=int(store.fill[page]))
            self.release(seq, page)

    def longest_hit(self, hashes, n):
        """Right to left (vLLM's SlidingWindowManager): the longest n whose last window's pages are all cached."""
        ps, length, run = self.page_size, 0, []  # cached pages in a row ending at each logical page
        for h in hashes[:n]:
            length = length + 1 if self.store.pages.lookup(h) is not None else 0
            run.append(length)
        while n and run[n - 1] < n - first_kept_page(n * ps, self.window, ps):
            n -= 1
        return n

    def hit_pages(self, hashes):
        first = first_kept_page(len(hashes) * self.page_size, self.window, self.page_size) if hashes else 0
        return [None] * first + [self.store.pages.lookup(h) for h in hashes[first:]]

    def after_hit(self, seq, n_tokens):
        if n_tokens:
            own = self.tables[seq.seq_id]
            own.dropped = first_kept_page(n_tokens, self.window, self.page_size)
            own.slid = own.dropped * self.page_size - 1

    def check_fork(self, parent, n):
        slid = self.tables[parent.seq_id].slid
        if n and slid >= max(0, first_visible(n, self.window)):  # (slid -1: nothing slid out yet)
            raise ConfigError("n_tokens", n, f"at least {slid + self.window} for sequence "
                              f"{parent.seq_id}: local layer {self.layer} (window {self.window}) no longer holds "
                              f"position {slid}")

    def mask(self, bias, key_positions, positions):
        bias[key_positions <= positions[:, None] - self.window] = -np.inf


MANAGERS: dict[type, type[LayerManager]] = {FullAttentionSpec: FullAttentionManager,
                                            SlidingWindowSpec: SlidingWindowManager}


def own_hole(layer: LayerManager, table: LayerTable) -> int | None:
    """The sequence's lowest empty slot (`table`: its table here) when its page needs nothing before a write -- a
    page of its own, neither shared, which `writable` would copy, nor named by a prefix hash, which it would forget:
    the slot `free_slot` would give, without its calls; None when it has no empty slot or its page needs more.
    (batch_writes.write_many inlines the same test: a 16-sequence step asks it of every layer.)"""
    if not table.holes:
        return None
    flat = min(table.holes)
    page, pages = flat // layer.page_size, layer.store.pages
    return flat if pages.ref_counts[page] == 1 and page not in pages.frame_hash else None


def layer_manager(spec: LayerSpec, *args) -> LayerManager:
    """The manager of a layer of this spec (then: the store, event log, sequences and pool size)."""
    return MANAGERS[type(spec)](spec, *args)

"""A session's view of the server's shared pool: only its own pages and events, its pages numbered as a pool
of its own would number them.

A /v1/sessions session is one request in the server's engine, among everyone else's. Its records (block
tables, slot maps, scores, attention, events) must show its own cache, not the pool: so each record keeps only
the session's events, and renames every page it holds to the id a pool of its own would have given it. That id
comes from a mirror: one BlockPool per layer, sized like the session's own cache, fed the session's own
allocations, shares, registrations and releases in the order they happened. Alone in a fresh pool the mirror
hands out the very ids the pool did, so a session's records equal a DecodeSession's of its own; with others
around its pages keep the same compact numbering (0 .. max_pages - 1), whatever the pool's ids are.
"""

from __future__ import annotations

import numpy as np

from pagevis.engine.session import PoolView
from pagevis.kvcache import EventKind
from pagevis.kvcache.block_pool import BlockPool

E = EventKind
RENAMED = {E.WRITE, E.EVICT, E.SWAP_OUT, E.FAULT_IN, E.SHARE}


class OwnPages(PoolView):
    """PoolView of one session in a shared engine. `seq_id` is set when its request is submitted."""

    def __init__(self, cache_config, pool_frames: int) -> None:
        self.page_size = cache_config.page_size
        self.n_pages = cache_config.n_page_ids
        self.pool_frames = pool_frames  # page ids per layer in the shared pool
        self.seq_id = -1
        self.cache = None  # the shared KVCacheManager, set with seq_id
        n_layers = cache_config.n_layers
        self.mirrors = [BlockPool(self.n_pages) for _ in range(n_layers)]
        self.own: list[dict[int, int]] = [{} for _ in range(n_layers)]  # pool page -> the session's page id

    def attach(self, seq_id: int, cache) -> None:
        self.seq_id, self.cache = seq_id, cache

    # --- events --------------------------------------------------------------------------------------
    def events(self, events, step: int) -> tuple:
        out = []
        for event in events:
            if event.seq != self.seq_id:
                continue
            out += self._renamed(event._replace(step=step, seq=0))
        self._settle()
        return tuple(out)

    def _renamed(self, event) -> list:
        kind, layer, page = event.kind, event.layer, event.page
        if layer < 0 or page < 0:
            return [event]
        own, mirror = self.own[layer], self.mirrors[layer]
        if kind is E.ALLOCATE:
            uncached, mine = self._allocate(layer, page, event)
            return [*uncached, event._replace(page=mine)]
        if kind is E.COPY_ON_WRITE:
            source = own.pop(event.detail, -1)
            if source >= 0:
                mirror.release(source)
            uncached, mine = self._allocate(layer, page, event)
            return [*uncached, event._replace(page=mine, detail=source)]
        if kind is E.SHARE and page not in own:
            page_hash = self.cache.page_hash(layer, page)
            cached = mirror.lookup(page_hash) if page_hash is not None else None
            if cached is not None and mirror.ref_counts[cached] == 0:
                mirror.share(cached)
                own[page] = cached
            else:
                uncached, mine = self._allocate(layer, page, event)
                if page_hash is not None:
                    mirror.register(mine, page_hash)
                return [*uncached, event._replace(page=mine)]
            return [event._replace(page=cached)]
        if kind is E.STORE:
            mirror.register(own[page], event.detail)
        elif kind is E.UNCACHE:
            if page not in own:  # the pool reclaimed a cached page for it: the mirror says so on allocating
                return []
            mirror.forget(own[page])
        elif kind is E.RELEASE:
            mine = own.pop(page, -1)
            if mine >= 0:
                mirror.release(mine)
            return [event._replace(page=mine)]
        return [event._replace(page=own.get(page, -1))]

    def _allocate(self, layer: int, page: int, event) -> tuple[list, int]:
        mine, old_hash = self.mirrors[layer].allocate()
        self.own[layer][page] = mine
        uncached = [] if old_hash is None else [event._replace(kind=E.UNCACHE, page=mine, slot=-1, position=-1,
                                                               detail=old_hash)]
        return uncached, mine

    def _settle(self) -> None:
        """Pages the session no longer holds that no event released (a shared page it let go, a preempted or
        freed sequence): released in the mirror too."""
        live = self.cache is not None and self.cache.has_sequence(self.seq_id)
        tables = self.cache.block_tables(self.seq_id) if live else [[] for _ in self.own]
        for layer, own in enumerate(self.own):
            held = set(tables[layer])
            for page in [p for p in own if p not in held]:
                self.mirrors[layer].release(own.pop(page))

    # --- arrays --------------------------------------------------------------------------------------
    def _to_own(self, layer: int) -> np.ndarray:
        """Per pool page, the session's id for it (-1: not its own)."""
        lookup = np.full(self.pool_frames, -1, dtype=np.int64)
        own = self.own[layer]
        if own:
            lookup[np.fromiter(own.keys(), np.int64)] = np.fromiter(own.values(), np.int64)
        return lookup

    def tables(self, tables):
        return [[self.own[layer][page] for page in table] for layer, table in enumerate(tables)]

    def held_slots(self, layer: int, frames, shown: int) -> np.ndarray:
        ps = self.page_size
        held = np.full(shown * ps, -1, dtype=np.int64)
        offsets = np.arange(ps)
        if frames.tiered:  # RAM frames are the pool's: show those holding the session's pages
            pages = frames.page_in[:shown]
            mine = (pages >= 0) & (self._to_own(layer)[np.maximum(pages, 0)] >= 0)
            for frame in np.flatnonzero(mine):
                held[frame * ps: (frame + 1) * ps] = pages[frame] * ps + offsets
            return held
        for page, mine in self.own[layer].items():
            held[mine * ps: (mine + 1) * ps] = page * ps + offsets
        return held

    def columns(self, layer: int, slots, width: int):
        ps = self.page_size
        flat = np.arange(width) if slots is None else np.asarray(slots)
        own = self._to_own(layer)[flat // ps]
        kept = own >= 0
        return own[kept] * ps + flat[kept] % ps, kept

    def page_map(self, layer: int, frames, n_pages: int) -> np.ndarray:
        ps = self.page_size
        out = np.full((n_pages, ps), -1, dtype=np.int64)
        for page, mine in self.own[layer].items():
            out[mine] = frames.positions[page * ps: (page + 1) * ps]
        return out

"""The prefix cache of one engine's pool as a forest: one node per full page registered under a prefix hash,
under the page before it. Qt-free; the Server window draws the nodes with the prefix-forest widget.

The pool knows each registered page's hash (KVCacheManager.cached_pages) but not its parent: a hash names a page by
its parent's hash and its own tokens (engine/prefix_cache.py), and cannot be read backwards. So the parent
links come from the requests themselves: each request's written tokens, hashed page by page with the engine's
own `page_hash`, give the chain its commits registered. Nodes are exactly the hashes the pool holds now
(layer 0: without eviction every layer holds the same pages); a chain's hash the pool never registered (the
same page was already cached under another frame) is no node.

Counts come from the engine's events: a page's hits are the PREFIX_HIT events whose reused tokens covered it;
`new` marks pages STOREd since the last snapshot and `removed` ghosts of pages UNCACHEd (their frame reclaimed
for other tokens) since then.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagevis.kvcache import EventKind
from pagevis.kvcache.prefix_cache import ROOT_HASH, page_hash
from pagevis.engine.session_config import decode_ids

NEW, REMOVED = 1, 2
STATES = ("shared", "in use", "cached")  # ref count > 1, == 1, 0 (free but still holding its prefix)
MAX_REMEMBERED = 200_000  # hashes kept for parent links; beyond this, those no longer in the pool are dropped


@dataclass(frozen=True)
class ForestNode:
    key: int  # the page's prefix hash
    parent: int | None  # the previous page's hash (None: the first page of a prompt, or its parent is gone)
    n_tokens: int
    state: str  # one of STATES ("removed" for a ghost)
    refs: int  # block-table entries pointing at the page (layer 0)
    hits: int  # times a later request's prefix match reused it
    page: int  # its frame in layer 0 (-1 for a ghost)
    owners: tuple[int, ...]  # request ids whose block tables hold it
    text: str  # its tokens' text
    flags: int  # NEW | REMOVED
    order: int  # when it was first seen (siblings in this order)


class PoolForest:
    """Follows one engine's steps (`observe`) and describes its prefix cache (`nodes`)."""

    def __init__(self, model, page_size: int):
        self.model, self.page_size = model, page_size
        self._chains: dict[int, list[int]] = {}  # sequence -> its page hashes so far
        self._info: dict[int, tuple[int, tuple[int, ...], int]] = {}  # hash -> (parent, tokens, order)
        self._texts: dict[int, str] = {}
        self.hits: dict[int, int] = {}
        self._new: set[int] = set()
        self._removed: set[int] = set()

    def observe(self, engine, record) -> None:
        """After each engine step (on the stepping thread): extend the chains of the requests fed, count hits."""
        for event in record.events:
            if event.kind is EventKind.PREFIX_HIT:
                chain = self._extend(engine.requests[event.seq], event.detail)
                for h in chain[: event.detail // self.page_size]:
                    self.hits[h] = self.hits.get(h, 0) + 1
        for s in record.seqs:
            request = engine.requests[s.seq_id]
            self._extend(request, request.n_cached)
        for event in record.events:
            if event.layer != 0:
                continue
            if event.kind is EventKind.STORE:
                self._new.add(event.detail)
                self._removed.discard(event.detail)
            elif event.kind is EventKind.UNCACHE:
                self._removed.add(event.detail)
                self._new.discard(event.detail)
        if len(self._info) > MAX_REMEMBERED:
            self._forget(engine)

    def _extend(self, request, n_tokens: int) -> list[int]:
        chain = self._chains.setdefault(request.seq_id, [])
        ps, tokens = self.page_size, None
        while (len(chain) + 1) * ps <= n_tokens:
            tokens = request.tokens if tokens is None else tokens
            i = len(chain)
            parent = chain[-1] if chain else ROOT_HASH
            page = tuple(tokens[i * ps: (i + 1) * ps])
            h = page_hash(parent, page)
            chain.append(h)
            if h not in self._info:
                self._info[h] = (parent, page, len(self._info))
        return chain

    def _forget(self, engine) -> None:
        held = engine.cache.cached_pages(0)
        self._info = {h: v for h, v in self._info.items() if h in held}
        self._chains = {s: c for s, c in self._chains.items() if engine.cache.has_sequence(s)}

    def nodes(self, engine, owners: dict[int, int] | None = None) -> tuple[ForestNode, ...]:
        """The pool's prefix cache now, and ghosts of the pages removed since the last call. `owners` maps
        sequence ids to the request ids shown (default: sequence ids)."""
        cache = engine.cache
        cached, ref_counts = cache.cached_pages(0), cache.pool(0).ref_counts
        holders: dict[int, list[int]] = {}
        for seq_id in cache.seq_ids():
            for page in cache.block_table(seq_id, 0):
                holders.setdefault(page, []).append(owners.get(seq_id, seq_id) if owners else seq_id)
        nodes = []
        for h, frame in cached.items():
            info = self._info.get(h)
            if info is None:
                continue  # registered by no request this forest saw (it was made after the pages were)
            parent, tokens, order = info
            refs = int(ref_counts[frame])
            state = STATES[0] if refs > 1 else STATES[1] if refs == 1 else STATES[2]
            nodes.append(ForestNode(h, parent if parent in cached else None, len(tokens), state, refs,
                                    self.hits.get(h, 0), frame, tuple(holders.get(frame, ())), self._text(h),
                                    NEW if h in self._new else 0, order))
        for h in self._removed - cached.keys():
            if h in self._info:
                parent, tokens, order = self._info[h]
                nodes.append(ForestNode(h, parent if parent in cached else None, len(tokens), "removed",
                                        0, self.hits.get(h, 0), -1, (), self._text(h), REMOVED, order))
        self._new, self._removed = set(), set()
        return tuple(nodes)

    def _text(self, h: int) -> str:
        text = self._texts.get(h)
        if text is None:
            text = self._texts[h] = decode_ids(self.model, self._info[h][1])
        return text

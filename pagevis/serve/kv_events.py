"""`pagevis serve --kv-events-endpoint`: the engines' prefix caches published as vLLM's KV events (the wire
format of issue 20, encoded by pagevis.attach), so whatever consumes vLLM's events — `pagevis attach`, a
KV-aware router — consumes pagevis too.

An engine hook turns each step's cache events into one batch: a `store` (a full page registered under its
prefix hash) becomes part of a BlockStored, one per run of consecutive newly full blocks of a request, with
vLLM's parent semantics (the hash of the block before the run, None for a first block) and the run's tokens;
an `uncache` (a cached free page reclaimed for new tokens, or rewritten by eviction) becomes a BlockRemoved.
Pages are per layer here, and layers of one kind hold the same prefix cache, so the first layer of each kind speaks
for its kind. On a model with sliding-window layers (Gemma 3) the two kinds differ (a local layer frees its pages as
its window slides): each kind is then a KV cache group of its own, as vLLM publishes a hybrid model's, its events
tagged with its `group_idx` (the order of `layer_groups`: the kind of layer 0 first); one kind publishes no group_idx.
Medium: "CPU" (RAM pages), "STORAGE" with the server's disk tier (page ids are disk frames). A pool that is
closed reports its cached blocks removed (other pools' blocks stay: not AllBlocksCleared).
"""

from __future__ import annotations

import threading

from pagevis.attach.events import BlockRemoved, BlockStored
from pagevis.attach.publisher import KVEventPublisher
from pagevis.kvcache import EventKind
from pagevis.kvcache.prefix_cache import prefix_hashes, salt_root


class KVEvents:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self.publisher = KVEventPublisher(endpoint, replay_endpoint, topic)
        self._lock = threading.Lock()  # one engine thread per pool publishes

    def watch(self, engine) -> None:
        engine.add_hook(lambda record: self.step(engine, record))

    def step(self, engine, record) -> None:
        events = batch_events(engine, record.events)
        if events:
            self.publish(events)

    def closing(self, engine) -> None:
        """The pool goes away: its cached blocks are gone."""
        gone = [BlockRemoved(block_hashes=cached, medium=medium(engine), group_idx=group)
                for group, layer in groups(engine) if (cached := list(engine.cache.cached_pages(layer)))]
        if gone:
            self.publish(gone)

    def publish(self, events: list) -> None:
        with self._lock:
            self.publisher.publish(events)

    def close(self) -> None:
        self.publisher.close()


def medium(engine) -> str:
    return "STORAGE" if engine.cache.config.tiered else "CPU"


def groups(engine) -> list[tuple[int | None, int]]:
    """(group_idx, the layer that speaks for it) per kind of layer: one group, of index None, without sliding-window
    layers."""
    firsts = [layers[0] for layers in engine.cache.layer_groups().values()]
    return [(None, firsts[0])] if len(firsts) == 1 else list(enumerate(firsts))


def batch_events(engine, cache_events) -> list:
    """The KV events of one step's cache events, in their order, group after group."""
    return [event for group, layer in groups(engine) for event in _layer_events(engine, cache_events, layer, group)]


def _layer_events(engine, cache_events, layer: int, group: int | None) -> list:
    """The KV events of one layer's cache events (the layer of its group), in their order."""
    out: list = []
    ps, where = engine.cache.page_size, medium(engine)
    run: list = []  # (seq, block index, hash, chain) of consecutive stored blocks of one request
    chains: dict[int, list[int]] = {}

    def flush() -> None:
        if run:
            seq, first, _, chain = run[0]
            request = engine.requests[seq]
            tokens, salt = request.tokens, request.prefix_salt
            out.append(BlockStored(block_hashes=[h for _, _, h, _ in run],
                                   parent_block_hash=chain[first - 1] if first else None,
                                   token_ids=[int(t) for t in tokens[first * ps: (first + len(run)) * ps]],
                                   block_size=ps, medium=where, group_idx=group,  # extra keys: a first block's salt
                                   extra_keys=[[salt]] + [None] * (len(run) - 1) if salt and not first else None))
            run.clear()

    for event in cache_events:
        if event.layer != layer:
            continue
        if event.kind is EventKind.STORE:
            request = engine.requests.get(event.seq)
            if request is None:
                continue
            chain = chains.get(event.seq)
            if chain is None:
                chain = chains[event.seq] = prefix_hashes(request.tokens, ps, salt_root(request.prefix_salt))
            if event.detail not in chain:
                continue
            index = chain.index(event.detail)
            if run and (run[0][0] != event.seq or run[-1][1] + 1 != index):
                flush()
            run.append((event.seq, index, event.detail, chain))
        elif event.kind is EventKind.UNCACHE:
            flush()
            out.append(BlockRemoved(block_hashes=[event.detail], medium=where, group_idx=group))
    flush()
    return out

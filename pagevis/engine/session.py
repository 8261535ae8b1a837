"""A decoding session: one request in the engine, advanced one step at a time, with the full snapshot of
every step (the app's main window, `run`, `compare` and the oracle use it).

Each call to `step()` steps the engine and returns one StepRecord. The prompt enters the cache in prefill
chunks that fit in the free slots (so a prompt longer than the cache is evicted from like any other text);
decode steps then feed one sampled token at a time. With `oracle` on, the same token stream also runs
through a full cache that never evicts, and every record carries the comparison. `restart()` decodes the
prompt again in the same engine: its full pages come from the prefix cache.

A session may also live in an engine others share (a server's): it is then one request among many, stepped
by the engine's owner, who calls `take_step` after each engine step that fed it; a `PoolView` shows its
records only its own pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Iterator

import numpy as np

from pagevis.kvcache import CacheFullError, ConfigError, EventKind, make_policy
from pagevis.kvcache.event_array import EventArray, Strings
from pagevis.kvcache.snapshot import CacheSnapshot
from pagevis.errors import check_int
from pagevis.engine.batch import BatchConfig
from pagevis.engine.engine import Engine
from pagevis.engine.oracle import FullCacheOracle
from pagevis.engine.request import Request
from pagevis.engine.step_record import StepRecord, TierStep
from pagevis.engine.run_loop import RunControl, steps
from pagevis.engine.table_log import TableLog
from pagevis.engine.session_config import MAX_NEW_TOKENS, SessionConfig, decode_ids, encode_prompt, token_text

__all__ = ["MAX_NEW_TOKENS", "DecodeSession", "SessionConfig", "decode_ids", "encode_prompt", "token_text"]

StepHook = Callable[[StepRecord], None]


class PoolView:
    """How a session's records show the pool: as it is, when the session owns its engine (every page and
    event is its own). A session in a shared engine is given one that shows only its own pages and events
    (pagevis.serve.session_pages)."""

    def events(self, events, step: int) -> tuple:
        """The step's events as the records show them."""
        return tuple(events)

    def tables(self, tables: list[list[int]]) -> list[list[int]]:
        return tables

    def holder(self, shown: int):
        """The snapshot's `held` (kvcache/snapshot.py) for `shown` frames: None when the records show the layers'
        own RAM frames as they are (this class), else this view's held_slots."""
        if type(self).held_slots is PoolView.held_slots:
            return None
        return lambda layer, frames: self.held_slots(layer, frames, shown)

    def held_slots(self, layer: int, frames, shown: int) -> np.ndarray | None:
        """Per slot of the `shown` frames the records show, the pool's flat slot it holds (-1: none); None:
        the layer's own RAM frames, as they are. frames: what they hold (kvcache.snapshot.LayerFrames)."""
        return None

    def columns(self, layer: int, slots: np.ndarray | None, width: int) -> tuple:
        """Where an attention result's weights go among the record's flat slots: (columns, which weights)."""
        return (slice(0, width) if slots is None else slots), slice(None)

    def page_map(self, layer: int, frames, n_pages: int) -> np.ndarray:
        """(n_pages, page_size) token position per slot of every page id (frames: LayerFrames)."""
        return frames.positions.reshape(n_pages, frames.page_size)


class DecodeSession:
    def __init__(self, model, prompt: str, config: SessionConfig | None = None,
                 prompt_ids: list[int] | None = None, policy=None, engine: Engine | None = None,
                 pool: PoolView | None = None, max_chunk: int | None = None):
        """policy: an eviction policy object instead of the settings' one (bound to the cache's budget).
        engine: a shared engine to live in (its owner steps it, calls `submit` on its stepping thread, then
        `take_step` after each step); pool: how records show that engine's pool. max_chunk: prompt tokens
        a step feeds (None: as many as fit; a teacher-forced session reads its text in smaller chunks)."""
        self.model = model
        self.config = config or SessionConfig()
        n_layers = model.config.n_layers
        layers = tuple(range(n_layers)) if self.config.record_layers is None else tuple(self.config.record_layers)
        for layer in layers:
            check_int("record_layers", layer, 0, n_layers - 1)
        self.record_layers = layers
        self.prompt = prompt
        if prompt_ids is None:
            prompt_ids = encode_prompt(model, prompt, self.config.chat, self.config.special)
        self.prompt_ids = tuple(prompt_ids)
        if not self.prompt_ids:
            raise ConfigError("prompt", prompt, "text that encodes to at least one token")
        self.shared = engine is not None
        self.cache_config = self.config.cache_config(model.config)  # built once, here: the engine is given it
        self.engine = engine or Engine(model, self.config, BatchConfig(max_seqs=1), max_chunk=max_chunk,
                                       hold_finished=True, cache_config=self.cache_config)
        self.cache = self.engine.cache
        self.cache.record_writes(True)  # the step record's events (on a shared engine too, from here on)
        self.pool = pool or PoolView()
        self.oracle = (FullCacheOracle(model, self.cache_config, len(self.prompt_ids) + self.config.max_new_tokens,
                                       self.record_layers) if self.config.oracle else None)
        self._hooks: list[StepHook] = []
        # False: records carry no grids of the cache (slot maps, protected slots, scores: no frames shown) unless a
        # disk tier or a page selection needs them, for a consumer that reads none (`run` without --trace)
        self.record_cache = True
        self._given_policy = policy
        self._policy = policy  # the request's: built once per submit (one per sequence), unless given
        self.seq_id = -1
        self.request: Request | None = None  # until submitted
        self.records: list[StepRecord] = []
        if not self.shared:
            self.submit()

    def submit(self) -> None:
        """Queue the session's request in its engine (a shared engine's owner calls this on its thread)."""
        config = self.config
        self._policy = self._given_policy or make_policy(self.cache_config)
        self.seq_id = self.engine.submit(self.prompt_ids, config.sampling, config.max_new_tokens, policy=self._policy)
        self.request = request = self.engine.requests[self.seq_id]
        request.hold = True  # the last record shows the cache as the request left it
        self.engine.watch_attention(self.seq_id, self.record_layers)
        self.records = []
        self._evictions = 0
        # the records' block tables (and RAM frames) as changes, not one copy per step
        self._tables = TableLog(self.cache_config.n_layers)
        self._strings = Strings()  # the records' events as arrays, their texts interned here
        self._frames = TableLog(self.cache_config.n_layers)

    def restart(self) -> None:
        """Decode the prompt again from the start, in the same cache: the pages of the prompt's full-page
        prefix that are still cached are not computed again (a prefix hit, counted in the cache's stats)."""
        self.engine.cancel(self.seq_id)
        self.engine.forget(self.seq_id)
        if self.oracle is not None:
            self.oracle.reset()
        self.submit()

    def close(self) -> None:
        if not self.shared:
            self.engine.close()

    # --- observers -----------------------------------------------------------------------------------
    def add_hook(self, hook: StepHook) -> None:
        """Call hook(record) on the stepping thread after every step (metrics, progress, servers...)."""
        self._hooks.append(hook)

    def remove_hook(self, hook: StepHook) -> None:
        self._hooks.remove(hook)

    # --- state ---------------------------------------------------------------------------------------
    @property
    def policy(self):
        """The request's eviction policy (the one its sequence evicts by, once the first step admits it)."""
        return self._policy

    @property
    def read_slots(self) -> list:
        """Per layer, the flat slots the last step's attention read (None: every resident slot)."""
        return self.cache.read_slots(self.seq_id)

    @property
    def submitted(self) -> Request:
        """The session's request (RuntimeError before `submit`)."""
        if self.request is None:
            raise RuntimeError("the session's request is not submitted yet")
        return self.request

    @property
    def sampler(self):
        return self.submitted.sampler

    @property
    def generated(self) -> list[int]:
        """Sampled tokens, in order."""
        return self.request.generated if self.request is not None else []

    @property
    def stop_reason(self) -> str | None:
        return self.request.stop_reason if self.request is not None else None

    @property
    def done(self) -> bool:
        """Finished for good. A request the cache could not take further ("cache_full") is not: stepping
        it again says why again (the app reports it; the steps so far stay)."""
        return self.request is not None and self.request.done and self.request.stop_reason != "cache_full"

    @property
    def next_position(self) -> int:
        return self.submitted.n_cached

    def text(self) -> str:
        """The generated text so far (not the prompt, not the end-of-sequence token that stopped it)."""
        if self.request is None:
            return ""
        ids = self.request.generated[:-1] if self.request.stop_reason == "eos" else self.request.generated
        return decode_ids(self.model, ids)

    def token_text(self, token_id: int) -> str:
        return token_text(self.model, token_id)

    # --- stepping ------------------------------------------------------------------------------------
    def run(self, control: RunControl | None = None) -> Iterator:
        """Step through the one run loop until done (or as `control` says); yield each record."""
        return steps(self, control)

    def step(self) -> StepRecord:
        """Advance one step. When the cache is full under policy 'none' the request ends ("cache_full") and
        CacheFullError says why; nothing changed in the cache."""
        if self.done:
            raise RuntimeError(f"the session has finished ({self.stop_reason}); restart to decode again")
        if self.submitted.done:
            raise CacheFullError(self.submitted.error)
        started = time.perf_counter()
        batch = self.engine.step()
        if self.seq_id not in self.engine.last_plan:
            raise CacheFullError(self.submitted.error or "the cache cannot take another token")
        return self.take_step(batch, started)

    def take_step(self, batch, started: float | None = None, counts=None) -> StepRecord:
        """The record of the engine step just taken, which fed this session's request (`batch`: its
        BatchRecord); appended to `records` and passed to the hooks. counts: the disk tier's counts of the
        step, when the engine's owner takes them (a shared engine); else the session takes them."""
        engine_done = time.perf_counter()
        if started is None:  # a shared engine's step: its own duration
            started = engine_done - batch.seconds
        tokens, start = self.engine.last_plan[self.seq_id]
        positions = np.arange(start, start + len(tokens), dtype=np.int64)
        kind = "prefill" if start < len(self.prompt_ids) else "decode"
        next_token = next(s.next_token for s in batch.seqs if s.seq_id == self.seq_id)
        oracle_step = None
        if self.oracle is not None:
            # Mid-prefill the next token is known (the prompt's), so the comparison is teacher-forced.
            scored = next_token if next_token >= 0 else self.prompt_ids[start + len(tokens)]
            self.oracle.catch_up(self.prompt_ids, start)
            oracle_step = self.oracle.step(np.asarray(tokens, dtype=np.int64), positions, self.cache, self.seq_id,
                                           self.engine.last_logits[self.seq_id], scored)
        oracle_done = time.perf_counter()
        record = self._record(kind, tokens, positions, next_token, oracle_step, counts)
        finished = time.perf_counter()
        forward, reconstruct = self.engine.forward_seconds, self.engine.reconstruct_seconds
        record.timings.update(forward=forward, sample=max(0.0, engine_done - started - forward - reconstruct),
                              oracle=oracle_done - engine_done, record=finished - oracle_done,
                              total=finished - started)
        if reconstruct:  # kvzip's reconstruction pass, after this step's prefill
            record.timings["reconstruct"] = reconstruct
        self.records.append(record)
        for hook in self._hooks:
            hook(record)
        return record

    def _no_grids(self) -> CacheSnapshot:
        """A snapshot showing no frame (record_cache off): its layers' capacities only."""
        cfg = self.cache_config
        shape = (cfg.n_layers, 0, cfg.page_size)
        return CacheSnapshot(
            slot_maps=np.zeros(shape, np.int32), protected=np.zeros(shape, bool), scores=np.zeros(shape, np.float32),
            full_precision=None, labels=(), block_frames=None,
            capacities=tuple(int(self.policy.layer_capacity(layer)) for layer in range(cfg.n_layers)))

    def _record(self, kind, tokens, positions, next_token, oracle_step, counts=None) -> StepRecord:
        pool, cfg, step = self.pool, self.cache_config, len(self.records)
        events = EventArray.pack(pool.events(self.engine.last_events, step), self._strings)
        self._evictions += len(events.of_kind(EventKind.EVICT))
        tables = self.cache.block_tables(self.seq_id)
        shown = cfg.max_pages if self.record_cache or cfg.tiered or self.cache.select_pages is not None else 0
        snap = self.cache.snapshot(self.seq_id, shown, pool.holder(shown)) if shown else self._no_grids()
        rows = np.zeros((len(self.record_layers), cfg.n_heads, cfg.capacity), dtype=np.float32)
        for row, layer in zip(rows, self.record_layers):
            last, slots = self.engine.attention[self.seq_id][layer]
            columns, kept = pool.columns(layer, slots, last.shape[1])
            row[:, columns] = last[:, kept]
        attention = tuple(to_half(rows)) if len(rows) else ()  # one conversion for every layer
        tiers = None
        if snap.block_frames is not None:  # a disk tier or a page selection
            tiers = TierStep(
                counts=np.array([c.as_tuple() for c in counts or self.cache.take_counts()], dtype=np.int64),
                page_maps=np.array([pool.page_map(layer, self.cache.frames(layer), cfg.n_page_ids)
                                    for layer in self.record_layers], dtype=np.int32
                                   ).reshape(len(self.record_layers), cfg.n_page_ids, cfg.page_size),
                block_frames=self._frames.record(step, snap.block_frames),
                recall=None if self.oracle is None else self.oracle.recall.copy())  # (the oracle reuses its array)
        return StepRecord(
            step=step, kind=kind, token_ids=tuple(int(t) for t in tokens),
            positions=tuple(int(p) for p in positions), next_token=int(next_token),
            next_text=self.token_text(next_token) if next_token >= 0 else "",
            slot_maps=snap.slot_maps, protected=snap.protected, scores=snap.scores,
            block_tables=self._tables.record(step, pool.tables(tables)),
            events=events, attention_layers=self.record_layers, attention=attention,
            timings={}, resident_tokens=self.cache.resident(self.seq_id, 0), pages_used=len(tables[0]),
            evictions_total=self._evictions, oracle=oracle_step, tiers=tiers, full_precision=snap.full_precision,
            capacities=np.array(snap.capacities, dtype=np.int32),
        )


def to_half(x: np.ndarray) -> np.ndarray:
    """float32 to float16, bit for bit NumPy's cast (round to nearest, ties to even), without that cast's slow path for
    float16's subnormals (|x| < 2**-14: ~40x slower a value; most attention weights after a few hundred tokens are
    there, and the record's conversion took 14 ms of a 44 ms SmolLM2 step after 512): those are rounded here as
    integers, x * 2**24 being their count of the smallest subnormal."""
    tiny = np.abs(x) < np.float32(2.0 ** -14)
    with np.errstate(over="ignore", invalid="ignore"):  # (the casts of values not kept: infinities, NaN)
        normal = np.where(tiny, np.float32(0), x).astype(np.float16).view(np.uint16)
        scaled = np.abs(x) * np.float32(2.0 ** 24)
        np.minimum(scaled, np.float32(1024), out=scaled)  # (a value this large is not tiny: only the tiny are kept)
        np.rint(scaled, out=scaled)
        bits = scaled.astype(np.uint16)
    bits |= np.signbit(x).astype(np.uint16) << np.uint16(15)
    return np.where(tiny, bits, normal).view(np.float16)

"""A server in miniature: the one Engine fed by arriving requests, on a server clock. Qt-free.

`ServerRun` is a stepper for the one run loop (`done`, `step()`): each step first hands the engine every
request that has arrived by now (the workload's seeded arrivals, `workload.py`), then runs one engine step
(continuous batching: whatever the scheduler admits, prefills in chunks, decodes, preempts) — or, when the
engine has nothing to do, waits for the next arrival. It returns a `ServerStep`: the engine's BatchRecord and
what the Server window plots, all read from the engine's own records (the BatchRecord, its events, the
Request fields, the scheduler's queues, the prefix-cache counters) at the end of that step.

The server clock: arrivals, TTFT, ITL and throughput are in server seconds. An engine step advances it by the
step's measured duration (or by `step_seconds` exactly, for reproducible tests); idle time passes in real
time with `realtime` (the app), else the clock jumps to the next arrival. Each side of an A/B has its own
clock, so each is timed as if it had the machine alone, and `ServerPair` steps whichever side is behind: the
two sides move through the same arrivals together.

Contiguous reservation, emulated honestly with the paged engine: a request is handed to the engine only when
its prompt + max_new_tokens (capped at the per-request capacity), rounded up to whole pages, fits beside the
reservations of every request the engine holds — what a server that reserves each request's maximum length
up front could admit. Until then it waits (in the `held` queue). The engine still stores the tokens in pages,
but admission, and so throughput, is the contiguous server's; prefix caching is off on such a side (a
contiguous reservation is one request's alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush

from pagevis import settings
from pagevis.kvcache import ConfigError, EventKind
from pagevis.errors import check_int
from pagevis.engine.batch import BatchConfig, BatchRecord
from pagevis.engine.engine import Engine
from pagevis.simserver.forest import ForestNode, PoolForest
from pagevis.engine.session_config import SessionConfig
from pagevis.settings import field_for
from pagevis.simserver.workload import Arrival, ArrivalSchedule
from pagevis.token_times import TokenTimes

PHASES = ("queued", "prefill", "decode", "preempted", "done")
RESERVATIONS = ("paged", "contiguous")


@dataclass(frozen=True)
class ServerConfig:
    """One side of the server: its pool and scheduler (the settings table's, with the Server window's own
    defaults), and how it reserves memory."""

    pool_pages: int = field_for("pool_pages", "server")  # page ids per layer in the one pool
    max_seqs: int = field_for("max_seqs", "server")  # requests running at once
    prefix_caching: bool = field_for("prefix_caching", "server")
    reservation: str = "paged"  # or "contiguous": see the module docstring
    token_budget: int | None = field_for("token_budget", "server")  # tokens one step feeds over all requests
    max_chunk: int | None = field_for("max_chunk", "server")  # prompt tokens one request feeds per step
    step_seconds: float | None = None  # None: an engine step takes the server clock its measured time
    realtime: bool = False  # idle time passes in real time (else the clock jumps to the next arrival)
    label: str = ""

    def __post_init__(self) -> None:
        check_int("pool_pages", self.pool_pages, 1, settings.MAX_PAGES)  # a number here: the pool is drawn
        settings.check(self, of=ServerConfig)
        if self.reservation not in RESERVATIONS:
            raise ConfigError("reservation", self.reservation, "paged or contiguous")
        if self.reservation == "contiguous" and self.prefix_caching:
            raise ConfigError("prefix_caching", True, "off with contiguous reservation (nothing is shared)")
        if self.step_seconds is not None and not self.step_seconds > 0:
            raise ConfigError("step_seconds", self.step_seconds, "a positive number of seconds, or None")

    def batch_config(self) -> BatchConfig:
        return BatchConfig(pool_pages=self.pool_pages, max_seqs=self.max_seqs, prefix_caching=self.prefix_caching,
                           token_budget=self.token_budget)


@dataclass(frozen=True)
class ServerStep:
    """One step of one side, as the plots and queues show it. Request ids are the workload's arrival ids
    (the same on both sides of an A/B); `owners` maps the record's sequence ids to them."""

    side: str
    step: int  # this side's steps, idle ones included
    t0: float  # server clock at the start and end of the step
    t1: float
    record: BatchRecord | None  # the engine's own record; None for an idle step
    pool: BatchRecord | None  # the newest engine record: the pool after this step (an idle step changes nothing)
    owners: dict[int, int]  # engine sequence id -> request id (of the pool record's block tables)
    arrived: tuple[int, ...]  # requests that arrived by t0 and were queued at this step
    waiting: tuple[int, ...]  # not running, in queue order: held by a contiguous reservation, then the engine's
    running: tuple[int, ...]  # the engine's running requests, in admission order
    preempted: tuple[int, ...]  # those waiting that were preempted (they recompute when admitted again)
    ended: tuple[int, ...]  # requests that ended in this step
    prefill_tokens: int  # tokens fed as prompt (or recompute) chunks in this step
    decode_tokens: int  # tokens fed as single decode tokens
    tokens_out: int  # tokens sampled in this step
    ttft: tuple[float, ...]  # time to first token of each request that got its first token in this step
    itl: tuple[float, ...]  # time since its previous token, of each request that got a later token
    pages_used: int  # of the fullest layer's pool (each layer has one; on Gemma 3 a global layer is the fullest)
    pool_pages: int
    reserved_pages: int  # what reserving prompt + max_new_tokens per request held by the engine would take
    prefix_queries: int  # the engine's prefix-cache counters so far, in tokens
    prefix_hits: int
    preemptions: int  # so far
    preempted_now: int  # in this step
    completed: int  # requests ended so far (rejected ones included)
    generated: int  # tokens sampled so far
    rejected: int = 0  # requests so far that could never run: prompt + max new tokens larger than the pool

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    @property
    def idle(self) -> bool:
        return self.record is None


@dataclass(frozen=True)
class RequestRow:
    """A request's life so far: phases over server time, and its numbers (from the engine's Request)."""

    id: int
    user: int
    turn: int
    arrival: float
    segments: tuple[tuple[str, float, float], ...]  # (phase, from, to), consecutive
    phase: str
    n_prompt: int
    n_generated: int
    max_new_tokens: int
    preemptions: int
    prefix_hit_tokens: int  # prompt tokens the prefix cache supplied, over all its admissions
    ttft: float | None
    stop_reason: str | None
    text: str


@dataclass(frozen=True)
class SideSnapshot:
    """What the slower views of one side show, taken between steps on the stepping thread."""

    side: str
    step: ServerStep | None  # the newest step (None before the first)
    requests: tuple[RequestRow, ...]
    forest: tuple[ForestNode, ...]


@dataclass
class _Track:
    arrival: Arrival
    seq_id: int = -1
    phase: str = "queued"
    segments: list = field(default_factory=list)  # [phase, t0, t1]
    times: TokenTimes = field(default_factory=TokenTimes)  # from its arrival, in server seconds
    prefix_hit_tokens: int = 0
    stop_reason: str | None = None

    def extend(self, phase: str, t0: float, t1: float) -> None:
        self.phase = phase
        if self.segments and self.segments[-1][0] == phase:
            self.segments[-1][2] = t1
        else:
            self.segments.append([phase, t0, t1])


class ServerRun:
    """One engine serving the arrivals of `schedule` (shared with the other side of an A/B)."""

    def __init__(self, model, session: SessionConfig, server: ServerConfig, schedule: ArrivalSchedule,
                 side: str = "A"):
        self.model, self.session_config, self.config, self.schedule = model, session, server, schedule
        self.side = side
        self.engine = Engine(model, session, server.batch_config(), max_chunk=server.max_chunk)
        self.page_size = session.page_size
        self.capacity = self.engine.cache_config.capacity
        self.clock = 0.0
        self.n_steps = 0
        self.tracks: dict[int, _Track] = {}  # request id -> its track, in arrival order
        self.by_seq: dict[int, int] = {}  # engine sequence id -> request id
        self.held: list[int] = []  # arrived, waiting for a contiguous reservation (request ids, in order)
        self.rejected: list[int] = []  # larger than the whole pool: never submitted
        self._next_first = 0  # the schedule's next first turn
        self._follow_ups: list[tuple[float, int, Arrival]] = []  # a heap by arrival time
        self._completed = 0
        self._generated = 0
        self.forest = PoolForest(model, self.page_size)
        self.last_step: ServerStep | None = None
        self._pool: BatchRecord | None = None

    def close(self) -> None:
        self.engine.close()

    # --- state -------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return (self.engine.done and not self.held and not self._follow_ups
                and self.schedule.get(self._next_first) is None)

    def set_max_running(self, n: int) -> None:
        """Requests that may run at once, from the next step on (the app's control)."""
        settings.setting("max_seqs").check(n)
        self.engine.scheduler.max_running = n

    def request_id(self, seq_id: int) -> int:
        return self.by_seq[seq_id]

    def reserved_pages(self) -> int:
        """Pages a contiguous reservation of prompt + max_new_tokens would hold for every request the engine
        holds now (waiting or running)."""
        return sum(self._reservation(self.engine.requests[self.tracks[r].seq_id]) for r in self._in_engine())

    def pages_used(self) -> int:
        """Pages in use in the fullest layer's pool: the one that runs out first (every layer has a pool of
        pool_pages; a sliding-window layer holds fewer than a global one)."""
        cache = self.engine.cache
        return max(cache.pages_used(layer) for layer in range(cache.config.n_layers))

    def _reservation(self, request) -> int:
        return -(-min(len(request.prompt_ids) + request.max_new_tokens, self.capacity) // self.page_size)

    def _in_engine(self) -> list[int]:
        return [self.by_seq[s] for s in (*self.engine.running, *self.engine.waiting)]

    # --- stepping ----------------------------------------------------------------------------------------
    def step(self) -> ServerStep:
        if self.done:
            raise RuntimeError("every request has been served")
        t0 = self.clock
        arrived = self._arrive(t0)
        self._admit()
        if self.engine.done:
            return self._idle(t0, arrived)
        started = time.perf_counter()
        record = self.engine.step()
        seconds = self.config.step_seconds or (time.perf_counter() - started)
        self.clock = t1 = t0 + seconds
        return self._account(t0, t1, record, arrived)

    def _arrive(self, now: float) -> list[int]:
        """Queue every request that has arrived by `now` (first turns, then follow-ups, by time)."""
        due: list[Arrival] = []
        while (arrival := self.schedule.get(self._next_first)) is not None and arrival.time <= now:
            due.append(arrival)
            self._next_first += 1
        while self._follow_ups and self._follow_ups[0][0] <= now:
            due.append(heappop(self._follow_ups)[2])
        due.sort(key=lambda a: (a.time, a.id))
        for arrival in due:
            track = self.tracks[arrival.id] = _Track(arrival, times=TokenTimes(arrival.time))
            track.extend("queued", arrival.time, now)
            pages = -(-(len(arrival.prompt_ids) + arrival.max_new_tokens) // self.page_size)
            if pages > self.config.pool_pages or len(arrival.prompt_ids) >= self.capacity:
                track.stop_reason = "rejected"  # it could never run: larger than the pool or the capacity
                track.extend("done", now, now)
                self.rejected.append(arrival.id)
                self._completed += 1
            else:
                self.held.append(arrival.id)
        return [a.id for a in due]

    def _admit(self) -> None:
        """Hand held requests to the engine: all of them (paged), or in order while their reservations fit."""
        contiguous = self.config.reservation == "contiguous"
        reserved = self.reserved_pages() if contiguous else 0
        while self.held:
            arrival = self.tracks[self.held[0]].arrival
            if contiguous:
                need = -(-min(len(arrival.prompt_ids) + arrival.max_new_tokens, self.capacity) // self.page_size)
                if reserved + need > self.config.pool_pages:
                    break
                reserved += need
            self.held.pop(0)
            sampling = replace(self.session_config.sampling, seed=arrival.seed % 2**32)
            seq_id = self.engine.submit(arrival.prompt_ids, sampling, arrival.max_new_tokens,
                                        ignore_eos=self.schedule.config.ignore_eos)
            self.tracks[arrival.id].seq_id = seq_id
            self.by_seq[seq_id] = arrival.id

    def _idle(self, t0: float, arrived: list[int]) -> ServerStep:
        """Nothing to run: wait for the next arrival (a slice of it in real time, or all of it at once)."""
        upcoming = [t for t in (getattr(self.schedule.get(self._next_first), "time", None),
                                self._follow_ups[0][0] if self._follow_ups else None) if t is not None]
        gap = max(0.0, min(upcoming) - t0) if upcoming else 0.0
        if self.config.realtime:
            gap = min(gap, 0.05)
            time.sleep(gap)
        self.clock = t1 = t0 + gap
        for rid in self.held:  # only a reservation that never fits could hold one here: not reachable
            self.tracks[rid].extend("queued", t0, t1)
        return self._snapshot(t0, t1, None, arrived, (), (), (), 0, ())

    def _account(self, t0: float, t1: float, record: BatchRecord, arrived: list[int]) -> ServerStep:
        engine = self.engine
        self.forest.observe(engine, record)
        fed = {s.seq_id: s for s in record.seqs}
        preempted_now = [e.seq for e in record.events if e.kind is EventKind.PREEMPT]
        for event in record.events:
            if event.kind is EventKind.PREFIX_HIT:
                self.tracks[self.by_seq[event.seq]].prefix_hit_tokens += event.detail
        ttft, itl = [], []
        waiting = set(engine.waiting)
        for rid in [*self._in_engine(), *(self.by_seq[s] for s in record.ended)]:
            track = self.tracks[rid]
            request = engine.requests[track.seq_id]
            s = fed.get(track.seq_id)
            if s is not None:
                phase = "prefill" if s.kind == "prefill" else "decode"
                if s.next_token >= 0:
                    first, seconds = track.times.token(t1)
                    (ttft if first else itl).append(seconds)
            elif track.seq_id in waiting:
                phase = "preempted" if request.preemptions else "queued"
            else:  # running, but the step's token budget left it out
                phase = track.phase
            track.extend(phase, t0, t1)
        for rid in self.held:
            self.tracks[rid].extend("queued", t0, t1)
        for seq_id in record.ended:
            self._end(self.by_seq[seq_id], t1)
        prefill = sum(s.n_tokens for s in record.seqs if s.kind == "prefill")
        decode = sum(s.n_tokens for s in record.seqs if s.kind == "decode")
        self._generated += record.tokens_decoded
        return self._snapshot(t0, t1, record, arrived, tuple(ttft), tuple(itl), preempted_now, prefill,
                              record.ended, decode)

    def _end(self, rid: int, t1: float) -> None:
        track = self.tracks[rid]
        request = self.engine.requests[track.seq_id]
        track.stop_reason = request.stop_reason
        track.extend("done", t1, t1)
        self._completed += 1
        if request.stop_reason in ("eos", "max_new_tokens", "stop"):
            follow = self.schedule.follow_up(track.arrival, request.tokens, t1)
            if follow is not None:
                heappush(self._follow_ups, (follow.time, follow.id, follow))

    def _snapshot(self, t0, t1, record, arrived, ttft, itl, preempted_now, prefill, ended, decode=0) -> ServerStep:
        engine, stats = self.engine, self.engine.cache.prefix_stats
        waiting = [*self.held, *(self.by_seq[s] for s in engine.waiting)]
        preempted = tuple(self.by_seq[s] for s in engine.waiting if engine.requests[s].preemptions)
        if record is not None:
            self._pool = record
        owners = {s: self.by_seq[s] for s in self._pool.block_tables} if self._pool is not None else {}
        self.n_steps += 1
        self.last_step = ServerStep(
            side=self.side, step=self.n_steps - 1, t0=t0, t1=t1, record=record, pool=self._pool, owners=owners,
            arrived=tuple(arrived), waiting=tuple(waiting), running=tuple(self.by_seq[s] for s in engine.running),
            preempted=preempted, ended=tuple(self.by_seq[s] for s in ended), prefill_tokens=prefill,
            decode_tokens=decode, tokens_out=record.tokens_decoded if record is not None else 0, ttft=ttft,
            itl=itl, pages_used=self.pages_used(), pool_pages=self.config.pool_pages,
            reserved_pages=self.reserved_pages(), prefix_queries=stats.queries, prefix_hits=stats.hits,
            preemptions=engine.preemptions, preempted_now=len(preempted_now), completed=self._completed,
            generated=self._generated, rejected=len(self.rejected))
        return self.last_step

    # --- what the slower views show (taken between steps, on the stepping thread) ------------------------
    def snapshot(self, limit: int = 400) -> SideSnapshot:
        return SideSnapshot(self.side, self.last_step, self.request_rows(limit), self.forest.nodes(self.engine,
                                                                                                   self.by_seq))

    def request_rows(self, limit: int = 400) -> tuple[RequestRow, ...]:
        """The newest `limit` requests (every live one among them), oldest first."""
        rows = []
        for rid in list(self.tracks)[-limit:]:
            track = self.tracks[rid]
            arrival = track.arrival
            request = self.engine.requests.get(track.seq_id) if track.seq_id >= 0 else None
            rows.append(RequestRow(
                id=rid, user=arrival.user, turn=arrival.turn, arrival=arrival.time,
                segments=tuple((p, a, b) for p, a, b in track.segments), phase=track.phase,
                n_prompt=len(arrival.prompt_ids), n_generated=len(request.generated) if request else 0,
                max_new_tokens=arrival.max_new_tokens, preemptions=request.preemptions if request else 0,
                prefix_hit_tokens=track.prefix_hit_tokens,
                ttft=track.times.ttft,
                stop_reason=track.stop_reason, text=arrival.text))
        return tuple(rows)


class ServerPair:
    """Two sides on the same arrivals, stepped in lockstep on their server clocks: each step advances the
    side that is behind (A on a tie), so both have seen the same arrivals up to the same server time."""

    def __init__(self, a: ServerRun, b: ServerRun):
        if a.schedule is not b.schedule:
            raise ValueError("both sides must read one ArrivalSchedule")
        self.a, self.b = a, b

    @property
    def sides(self) -> tuple[ServerRun, ServerRun]:
        return self.a, self.b

    @property
    def done(self) -> bool:
        return self.a.done and self.b.done

    def step(self) -> ServerStep:
        live = [side for side in self.sides if not side.done]
        if not live:
            raise RuntimeError("both sides have served every request")
        return min(live, key=lambda side: side.clock).step()

    def close(self) -> None:
        for side in self.sides:
            side.close()


COMPARES = {"": "one server", "prefix": "prefix caching on vs off", "contiguous": "paged vs contiguous reservation"}


def side_configs(server: ServerConfig, compare: str = "") -> list[ServerConfig]:
    """The sides of a comparison on `server`'s pool and scheduler: one side (as given); prefix caching on (A)
    against off (B); or paged (A) against contiguous reservation (B), neither caching prefixes, so the only
    difference is when memory is taken."""
    if compare not in COMPARES:
        raise ConfigError("compare", compare, "one of " + ", ".join(repr(c) for c in COMPARES))
    if compare == "prefix":
        return [replace(server, reservation="paged", prefix_caching=True, label="prefix caching on"),
                replace(server, reservation="paged", prefix_caching=False, label="prefix caching off")]
    if compare == "contiguous":
        return [replace(server, reservation="paged", prefix_caching=False, label="paged (pages as tokens come)"),
                replace(server, reservation="contiguous", prefix_caching=False,
                        label="contiguous (prompt + max new tokens reserved)")]
    label = server.label or ("paged, prefix caching" if server.prefix_caching else "paged")
    return [replace(server, label=label)]

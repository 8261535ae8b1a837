"""Prometheus metrics of decoding: a server's engines, fed by an engine hook, and the sessions of `pagevis run`
and the app, fed by each session's step hook.

One `Metrics` owns its own CollectorRegistry (never prometheus_client's global one), so several servers,
the app and the tests never collide. `Metrics.observe_engine(name)` gives the `EngineObserver` a server's
engine core calls after every step and on every request's arrival, pause, resume and end (names after vLLM's
where one exists: requests running and waiting, the pool's KV cache usage, prefix-cache queries and hits in
tokens, preemptions, time to first token, inter-token latency, end-to-end latency, queue time).
`Metrics.observe(session)` subscribes a `SessionObserver` to a one-request DecodeSession; `serve_metrics(metrics,
port)` exposes the registry over HTTP for `pagevis run` and the app (the server mounts the same registry at
/metrics). Imports prometheus_client only: no FastAPI, no Qt.

What a SessionObserver observes, per step record:
  - a decode step's duration -> inter-token latency (the seconds one more token cost, oracle included);
  - the steps up to and including the first sampled token -> time to first token (their summed duration,
    so a client's pauses between steps never count);
  - prompt tokens fed, tokens generated, cache events by kind, evictions by policy, and with a disk tier
    its page faults (fault_in events), bytes written and read, and pages read from RAM and from disk;
  - the session's KV cache usage: its resident tokens over its capacity, summed over every layer, and per kind
    of layer (Gemma 3's sliding-window layers apart from its global ones) on the layer gauge as engine
    "sessions"; the K/V bytes its cache takes at capacity (pages, scales and zero points, a quantized cache's
    residual window; all layers).
Each observer keeps O(1) state; nothing grows with steps.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagevis.token_times import TokenTimes

SESSIONS = "sessions"  # the layer usage gauge's engine label for the sessions of `run` and the app
PAGE_FAULT_KIND = "fault_in"  # the disk tier's event: a page read from disk into a RAM frame
# A record's `tiers.count(name)` (per layer; records of sessions with a disk tier) -> what is counted.
TIER_BYTES = {"bytes_written": "swap_out", "bytes_read": "fault_in"}
TIER_READS = {"hits": "ram", "faults": "disk"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_MIXES = ("decode", "prefill", "mixed")  # a server step's rows: decode rows only, prompt rows only, or both
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    """The metric families of one process (a server, a `pagevis run`, an app) on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.inter_token_latency = Histogram(
            "pagevis_inter_token_latency_seconds", "Seconds each decode step took to produce one more token",
            buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "pagevis_time_to_first_token_seconds",
            "Seconds of stepping (prefill) from a session's first step to its first sampled token",
            buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagevis_prompt_tokens", "Prompt tokens fed into KV caches", registry=r)
        self.generation_tokens = Counter("pagevis_generation_tokens", "Tokens sampled by decoding sessions",
                                         registry=r)
        self.steps = Counter("pagevis_steps", "Session steps by kind (prefill chunk or decode)", ["kind"],
                             registry=r)
        self.engine_step_seconds = Histogram(
            "pagevis_engine_step_seconds", "Seconds a server engine's step took (its forward over every running "
            "request, sampling and the cache's bookkeeping), by its rows: decode (one generated token per request), "
            "prefill (prompt rows only) or mixed", ["mix"], buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            "pagevis_iteration_tokens", "Tokens (rows) a server engine's step fed over all its requests, by the "
            "step's rows (decode, prefill, mixed): a decode step's count is its batch", ["mix"],
            buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.evictions = Counter("pagevis_evictions", "Tokens evicted from KV caches, by eviction policy",
                                 ["policy"], registry=r)
        self.cache_events = Counter("pagevis_cache_events", "KV cache events by kind (allocate, write, evict, "
                                    "release, and the disk tier's swap_out/fault_in)", ["kind"], registry=r)
        self.page_faults = Counter("pagevis_page_faults", "Pages read back from the disk tier into RAM",
                                   registry=r)
        self.swapped_bytes = Counter("pagevis_swapped_bytes", "K/V bytes written to (swap_out) and read from "
                                     "(fault_in) the disk tier", ["kind"], registry=r)
        self.page_reads = Counter("pagevis_page_reads", "Pages attention read, by the tier they were in (ram, disk)",
                                  ["tier"], registry=r)
        self.prefix_cache_queries = Counter("pagevis_prefix_cache_queries", "Prompt tokens looked up in the "
                                            "shared pool's prefix cache", registry=r)
        self.prefix_cache_hits = Counter("pagevis_prefix_cache_hits", "Prompt tokens whose K/V came from the "
                                         "prefix cache", registry=r)
        self.preemptions = Counter("pagevis_preemptions", "Sequences preempted (freed, to be recomputed) when "
                                   "the shared pool ran out", registry=r)
        self.kv_cache_usage = Gauge("pagevis_kv_cache_usage_ratio", "Share (0-1) of the KV cache in use: a "
                                    "server's pools (slots of pages some request holds, every layer's pool), or "
                                    "the resident tokens of the sessions of `run` and the app, every layer)", registry=r)
        self.kv_cache_layer_usage = Gauge("pagevis_kv_cache_layer_usage_ratio", "Share (0-1) of a server "
                                          "engine's pools in use (or, as engine 'sessions', of the resident "
                                          "tokens of `run`'s and the app's sessions), by kind of layer ('global'; "
                                          "on a hybrid model such as Gemma 3 also 'local W=...', its "
                                          "sliding-window layers)", ["engine", "layers"], registry=r)
        self.active_sessions = Gauge("pagevis_active_sessions", "Decoding sessions alive now", registry=r)
        self.requests_running = Gauge("pagevis_requests_running", "Requests in a server engine's running batch "
                                      "(paused sessions not included)", registry=r)
        self.requests_waiting = Gauge("pagevis_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.requests_paused = Gauge("pagevis_requests_paused", "Sessions between HTTP calls: their pages "
                                     "held, not running", registry=r)
        self.e2e_latency = Histogram("pagevis_e2e_request_latency_seconds", "Seconds from a request's arrival "
                                     "to its end (a session's pauses between calls not counted)",
                                     buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("pagevis_request_queue_time_seconds", "Seconds a request waited before "
                                    "its first step", buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.kv_cache_bytes = Gauge("pagevis_kv_cache_bytes", "K/V bytes of all live sessions' caches at capacity, "
                                    "all layers (a quantized cache's scales, zero points and residual window "
                                    "included)", registry=r)
        self.kv_bytes_per_token = Gauge("pagevis_kv_cache_bytes_per_token", "pagevis_kv_cache_bytes over the "
                                        "tokens those caches hold at capacity (per layer 0 token)", registry=r)
        self._lock = threading.Lock()
        # session observer id -> kind of layer -> (resident tokens, capacity) summed over those layers
        self._usage: dict[int, dict[str, tuple[int, int]]] = {}
        self._engines: list[EngineObserver] = []
        # observer id -> its cache's K/V bytes at capacity, and the tokens it holds at capacity (per layer 0 token)
        self._bytes: dict[int, tuple[float, int]] = {}
        self.kv_cache_usage.set_function(self._usage_ratio)
        self.kv_cache_bytes.set_function(lambda: sum(b for b, _ in self._bytes.values()))
        self.kv_bytes_per_token.set_function(self._bytes_per_token)
        self.active_sessions.set_function(lambda: len(self._usage))
        for gauge, attribute in ((self.requests_running, "running"), (self.requests_waiting, "waiting"),
                                 (self.requests_paused, "paused_requests")):
            gauge.set_function(lambda attribute=attribute: sum(getattr(e, attribute) for e in self._engines))

    def observe_engine(self, name: str) -> EngineObserver:
        """An observer for one server engine (its core calls it); `forget_engine` when the engine goes."""
        observer = EngineObserver(self, name)
        with self._lock:
            self._engines.append(observer)
        return observer

    def forget_engine(self, observer: EngineObserver) -> None:
        with self._lock:
            if observer in self._engines:
                self._engines.remove(observer)
        for label in observer.groups:
            self.kv_cache_layer_usage.remove(observer.name, label)

    def observe(self, session) -> SessionObserver:
        """Count this session's steps from now on (until `observer.close()`)."""
        observer = SessionObserver(self, session)
        session.add_hook(observer)
        return observer

    def _set_usage(self, key: int, usage: dict[str, tuple[int, int]]) -> None:
        with self._lock:
            new = [label for label in usage if not any(label in u for u in self._usage.values())]
            self._usage[key] = usage
        for label in new:
            self.kv_cache_layer_usage.labels(SESSIONS, label).set_function(
                lambda label=label: self._usage_ratio(label))

    def _forget(self, key: int) -> None:
        with self._lock:
            gone = self._usage.pop(key, {})
            self._bytes.pop(key, None)
            unused = [label for label in gone if not any(label in u for u in self._usage.values())]
        for label in unused:
            self.kv_cache_layer_usage.remove(SESSIONS, label)

    def _bytes_per_token(self) -> float:
        with self._lock:
            capacity = sum(c for _, c in self._bytes.values())
            return sum(b for b, _ in self._bytes.values()) / capacity if capacity else 0.0

    def _usage_ratio(self, label: str | None = None) -> float:
        """Resident over capacity of every session and every server engine (all layers); with a label, of the
        sessions' layers of that kind."""
        with self._lock:
            parts = [pair for usage in self._usage.values() for kind, pair in usage.items()
                     if label is None or kind == label]
            if label is None:
                parts += [(e.used_slots, e.slots) for e in self._engines]
        capacity = sum(c for _, c in parts)
        return sum(r for r, _ in parts) / capacity if capacity else 0.0


class EngineObserver:
    """What one server engine did: its core calls `step` after every step (on the engine thread) and the
    request calls (`arrived`, `paused`, `resumed`, `finished`) as they happen. Per request it keeps its
    arrival, first step, last token and paused time, until the request ends; nothing else grows."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.metrics, self.name = metrics, name
        self.running = self.waiting = self.paused_requests = 0
        self.used_slots = self.slots = 0  # over every layer's pool
        self.groups: set[str] = set()  # the kinds of layer its usage gauge has been set for
        self._prefix = (0, 0)  # the pool's prefix-cache queries and hits counted so far
        self._requests: dict[int, _Timeline] = {}

    # --- requests --------------------------------------------------------------------------------
    def arrived(self, engine, seq_id: int, at: float | None = None) -> None:
        """A request joined the engine; `at`: when it was handed to the engine thread (time.monotonic(): a request
        that came during a step waits from then), else now."""
        self._requests[seq_id] = _Timeline(time.monotonic() if at is None else at)

    def paused(self, engine, seq_id: int) -> None:
        timeline = self._requests.get(seq_id)
        if timeline is not None:
            timeline.paused_at = time.monotonic()

    def resumed(self, engine, seq_id: int) -> None:
        timeline = self._requests.get(seq_id)
        if timeline is not None and timeline.paused_at is not None:
            timeline.shift(time.monotonic() - timeline.paused_at)

    def finished(self, engine, seq_id: int) -> None:
        timeline = self._requests.pop(seq_id, None)
        if timeline is not None:
            self.metrics.e2e_latency.observe(time.monotonic() - timeline.arrival)
        self.queues(engine)

    def queues(self, engine) -> None:
        scheduler = engine.scheduler
        self.running = scheduler.n_active
        self.waiting = len(scheduler.waiting)
        self.paused_requests = len(scheduler.running) - self.running
        cache = engine.cache
        used_pages = 0
        for label, layers in cache.layer_groups().items():
            used = sum(cache.pages_used(layer) for layer in layers)
            self.metrics.kv_cache_layer_usage.labels(self.name, label).set(used / (len(layers) * cache.pool_pages))
            self.groups.add(label)
            used_pages += used
        self.used_slots = used_pages * cache.page_size
        self.slots = cache.config.n_layers * cache.pool_pages * cache.page_size

    # --- steps -----------------------------------------------------------------------------------
    def step(self, record, engine, counts=None) -> None:
        m, now = self.metrics, time.monotonic()
        fed = [seq for seq in record.seqs if seq.kind != "fork"]
        if fed:
            prompt = sum(seq.feeds_prompt for seq in fed)
            mix = STEP_MIXES[0 if not prompt else 1 if prompt == len(fed) else 2]
            m.engine_step_seconds.labels(mix).observe(record.seconds)
            m.iteration_tokens.labels(mix).observe(sum(seq.n_tokens for seq in fed))
        for seq in record.seqs:
            m.steps.labels(seq.kind).inc()
            timeline = self._requests.get(seq.seq_id)
            if timeline is None:
                continue
            if timeline.first_step is None:
                timeline.first_step = now
                m.queue_time.observe(max(0.0, now - record.seconds - timeline.arrival))
                if seq.kind != "fork":  # parallel samples share their prompt: counted once
                    m.prompt_tokens.inc(len(engine.requests[seq.seq_id].prompt_ids))
            if seq.next_token >= 0:
                m.generation_tokens.inc()
                first, seconds = timeline.token(now)
                (m.time_to_first_token if first else m.inter_token_latency).observe(seconds)
        count_events(m, record.events)
        if counts is not None:
            for name, kind in TIER_BYTES.items():
                m.swapped_bytes.labels(kind).inc(sum(getattr(c, name) for c in counts))
            for name, tier in TIER_READS.items():
                m.page_reads.labels(tier).inc(sum(getattr(c, name) for c in counts))
        stats = engine.cache.prefix_stats
        queries, hits = self._prefix
        m.prefix_cache_queries.inc(stats.queries - queries)
        m.prefix_cache_hits.inc(stats.hits - hits)
        self._prefix = (stats.queries, stats.hits)
        self.queues(engine)


def count_events(m: Metrics, events, policy: str = "") -> None:
    """A step's cache events: by kind, the disk tier's page faults, preemptions, and evictions by policy (an event
    without one: `policy`, the session's)."""
    kinds: dict[str, int] = {}
    evicted: dict[str, int] = {}
    for event in events:
        kind = event.kind.value
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "evict":
            evicted[event.policy or policy] = evicted.get(event.policy or policy, 0) + 1
    for kind, count in kinds.items():
        m.cache_events.labels(kind).inc(count)
    m.page_faults.inc(kinds.get(PAGE_FAULT_KIND, 0))
    m.preemptions.inc(kinds.get("preempt", 0))
    for name, count in evicted.items():
        m.evictions.labels(name).inc(count)


class _Timeline(TokenTimes):
    """One request's times (time.monotonic), shifted by its pauses so that they never count."""

    __slots__ = ("first_step", "paused_at")

    def __init__(self, arrival: float) -> None:
        super().__init__(arrival)
        self.first_step: float | None = None
        self.paused_at: float | None = None

    def shift(self, seconds: float) -> None:
        super().shift(seconds)
        if self.first_step is not None:
            self.first_step += seconds
        self.paused_at = None


class SessionObserver:
    """A DecodeSession step hook that feeds `Metrics`; `close()` when the session goes away."""

    def __init__(self, metrics: Metrics, session) -> None:
        self.metrics = metrics
        self.session = session
        cfg = session.cache_config
        self.capacity = cfg.capacity
        self.policy = cfg.policy
        self._before_first_token = 0.0  # seconds stepped before the first sampled token; None after it
        self._tokens = 0
        metrics._set_usage(id(self), self._usage())
        with metrics._lock:
            metrics._bytes[id(self)] = (cfg.kv_bytes_per_token() * cfg.capacity, cfg.capacity)

    def __call__(self, record) -> None:
        m = self.metrics
        seconds = record.timings.get("total", 0.0)
        m.steps.labels(record.kind).inc()
        if record.kind == "prefill":
            m.prompt_tokens.inc(len(record.token_ids))
        if record.next_token >= 0:
            m.generation_tokens.inc()
            self._tokens += 1
            if self._tokens == 1:
                m.time_to_first_token.observe(self._before_first_token + seconds)
        else:
            self._before_first_token += seconds
        if record.kind == "decode":
            m.inter_token_latency.observe(seconds)
        count_events(m, record.events, self.policy)
        self._count_tiers(getattr(record, "tiers", None))
        m._set_usage(id(self), self._usage())

    def _usage(self) -> dict[str, tuple[int, int]]:
        """Per kind of layer: the session's resident tokens and its capacity, summed over those layers."""
        return {label: (sum(held), len(held) * self.capacity)
                for label, held in self.session.cache.resident_by_layers(self.session.seq_id).items()}

    def _count_tiers(self, tiers) -> None:
        """Bytes and page reads of the disk tier, from the step's own counts (a clean page that leaves RAM
        is not rewritten, so bytes cannot be inferred from events)."""
        if tiers is None:
            return
        for name, kind in TIER_BYTES.items():
            self.metrics.swapped_bytes.labels(kind).inc(int(tiers.count(name).sum()))
        for name, tier in TIER_READS.items():
            self.metrics.page_reads.labels(tier).inc(int(tiers.count(name).sum()))

    def close(self) -> None:
        """Stop observing: the session leaves the active count and the usage ratio."""
        try:
            self.session.remove_hook(self)
        except ValueError:
            pass
        self.metrics._forget(id(self))


def serve_metrics(metrics: Metrics, port: int, host: str = "127.0.0.1"):
    """Expose `metrics` at http://host:port/metrics from a daemon thread; returns the WSGI server
    (its `server_port` is the bound port, `shutdown()` stops it). Raises OSError if the port is taken."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server

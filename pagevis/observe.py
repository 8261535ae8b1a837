"""Prometheus metrics of decoding sessions, fed by each session's step hook.

One `Metrics` owns its own CollectorRegistry (never prometheus_client's global one), so several servers,
the app and the tests never collide. `Metrics.observe(session)` subscribes a `SessionObserver` to a
DecodeSession; `serve_metrics(metrics, port)` exposes the registry over HTTP for `pagevis run` and the app
(the server mounts the same registry at /metrics). Imports prometheus_client only: no FastAPI, no Qt.

What is observed, per step record:
  - a decode step's duration -> inter-token latency (the seconds one more token cost, oracle included);
  - the steps up to and including the first sampled token -> time to first token (their summed duration,
    so a client's pauses between steps never count);
  - prompt tokens fed, tokens generated, cache events by kind, evictions by policy, and with a disk tier
    its page faults (fault_in events), bytes written and read, and pages read from RAM and from disk;
  - the session's KV cache usage (resident tokens over capacity, layer 0).
Each observer keeps O(1) state; nothing grows with steps.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PAGE_FAULT_KIND = "fault_in"  # the disk tier's event: a page read from disk into a RAM frame
# A record's `tiers.count(name)` (per layer; records of sessions with a disk tier) -> what is counted.
TIER_BYTES = {"bytes_written": "swap_out", "bytes_read": "fault_in"}
TIER_READS = {"hits": "ram", "faults": "disk"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


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
        self.kv_cache_usage = Gauge("pagevis_kv_cache_usage_ratio", "Resident tokens over capacity (0-1) of "
                                    "all live sessions' KV caches together (layer 0)", registry=r)
        self.active_sessions = Gauge("pagevis_active_sessions", "Decoding sessions alive now", registry=r)
        self._lock = threading.Lock()
        self._usage: dict[int, tuple[int, int]] = {}  # observer id -> (resident, capacity)
        self.kv_cache_usage.set_function(self._usage_ratio)
        self.active_sessions.set_function(lambda: len(self._usage))

    def count_batch(self, batch, prompt_tokens: int, generated: int) -> None:
        """Add a finished many-sequence run (a BatchSession): its prefix-cache lookups, preemptions and
        tokens (the prompt is counted once: parallel samples share it)."""
        stats = batch.cache.prefix_stats
        self.prefix_cache_queries.inc(stats.queries)
        self.prefix_cache_hits.inc(stats.hits)
        self.preemptions.inc(batch.preemptions)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)

    def observe(self, session) -> SessionObserver:
        """Count this session's steps from now on (until `observer.close()`)."""
        observer = SessionObserver(self, session)
        session.add_hook(observer)
        return observer

    def _set_usage(self, key: int, resident: int, capacity: int) -> None:
        with self._lock:
            self._usage[key] = (resident, capacity)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._usage.pop(key, None)

    def _usage_ratio(self) -> float:
        with self._lock:
            capacity = sum(c for _, c in self._usage.values())
            return sum(r for r, _ in self._usage.values()) / capacity if capacity else 0.0


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
        metrics._set_usage(id(self), 0, self.capacity)

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
        self._count_events(record.events)
        self._count_tiers(getattr(record, "tiers", None))
        m._set_usage(id(self), record.resident_tokens, self.capacity)

    def _count_events(self, events) -> None:
        m = self.metrics
        kinds: dict[str, int] = {}
        evicted: dict[str, int] = {}
        for event in events:
            kind = event.kind.value
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "evict":
                evicted[event.policy or self.policy] = evicted.get(event.policy or self.policy, 0) + 1
        for kind, count in kinds.items():
            m.cache_events.labels(kind).inc(count)
            if kind == PAGE_FAULT_KIND:
                m.page_faults.inc(count)
        for policy, count in evicted.items():
            m.evictions.labels(policy).inc(count)

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

"""What one `pagevis serve` process serves and the limits it keeps: every field but the model, the request
defaults and the sweep interval is a setting of the table (pagevis/settings.py), with serve's own defaults.

Requests that name no cache get a full one: policy none (serve's default) and, while `full_cache` (no
`--max-pages` on the command line), room for --max-cache-tokens within the pool in the request's own page
size — so no completion evicts and a shared system prompt's full pages are all prefix-cache hits. A request
that names a policy and max_pages gets exactly those."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagevis import settings
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.settings import field_for

MIB = 1 << 20


def serve_defaults() -> SessionConfig:
    """The cache and decoding settings of requests that set none: the table's, with serve's own defaults."""
    return settings.for_front_end(SessionConfig(), "serve")


@dataclass(frozen=True)
class ServeSettings:
    model_spec: ModelSpec = field(default_factory=ModelSpec)
    # Cache and decoding settings of sessions and completions that do not set them (`pagevis serve
    # --policy sinks ...`); a request's settings change these as the same flags would.
    defaults: SessionConfig = field(default_factory=serve_defaults)
    full_cache: bool = True  # requests naming no max_pages get full_cache_pages(); False: defaults.max_pages
    host: str = field_for("host", "serve")
    port: int = field_for("port", "serve")
    allow_remote: bool = field_for("allow_remote", "serve")
    max_body: int = field_for("max_body", "serve")  # bytes of one request body
    max_sessions: int = field_for("max_sessions", "serve")  # live /v1/sessions sessions
    max_seqs: int = field_for("max_seqs", "serve")  # requests in one engine's running batch (--max-running)
    max_waiting: int = field_for("max_waiting", "serve")  # completions in flight beyond max_seqs; more get 429
    token_budget: int | None = field_for("token_budget", "serve")  # tokens one step feeds over all requests
    max_chunk: int = field_for("max_chunk", "serve")  # prompt tokens one request feeds per step
    pool_pages: int | None = field_for("pool_pages", "serve")  # None: --max-cache-tokens of pages
    int8_rows: str = field_for("int8_rows", "serve")  # which rows take int8 (VNNI CPUs): BatchConfig.int8_rows
    max_pools: int = field_for("max_pools", "serve")  # engines at once, one per cache layout
    drain_seconds: float = field_for("drain_seconds", "serve")  # on SIGTERM: how long in-flight requests go on
    kv_events_endpoint: str | None = field_for("kv_events_endpoint", "serve")  # vLLM KV events (ZMQ PUB) here
    kv_events_replay: str | None = field_for("kv_events_replay", "serve")  # and replay requests (ZMQ ROUTER)
    kv_events_topic: str = field_for("kv_events_topic", "serve")
    request_log: str | None = field_for("request_log", "serve")  # JSONL of each completion (request_log.py)
    max_session_tokens: int = field_for("max_session_tokens", "serve")  # prompt + generated tokens of one request
    max_cache_tokens: int = field_for("max_cache_tokens", "serve")  # page_size * max_pages of one request
    max_session_mib: int = field_for("max_session_mib", "serve")  # one session's KV caches and snapshots
    idle_timeout: float = field_for("idle_timeout", "serve")  # seconds a session may sit unused
    workers: int = field_for("workers", "serve")  # threads for /v1/attention, encoding, answers
    expiry_interval: float = 5.0  # seconds between sweeps for idle sessions

    def __post_init__(self) -> None:
        settings.check(self)

    @property
    def max_session_bytes(self) -> int:
        return self.max_session_mib * MIB

    def pool_pages_for(self, page_size: int) -> int:
        """Pages of a new pool of this page size: --pool-pages, else --max-cache-tokens' worth."""
        return self.pool_pages if self.pool_pages is not None else math.ceil(self.max_cache_tokens / page_size)

    def full_cache_pages(self, page_size: int) -> int:
        """A request's full cache: --max-cache-tokens in whole pages of this size, within the pool."""
        return max(1, min(self.max_cache_tokens // page_size, self.pool_pages_for(page_size)))

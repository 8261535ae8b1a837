"""What one `pagevis serve` process serves and the limits it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagevis.engine import ModelSpec, SessionConfig
from pagevis.errors import check_int

MIB = 1 << 20


@dataclass(frozen=True)
class ServeSettings:
    model_spec: ModelSpec = field(default_factory=ModelSpec)
    # Cache and decoding settings of sessions and completions that do not set them (`pagevis serve
    # --page-size 8 ...`); a request's settings change these as the same flags would.
    defaults: SessionConfig = field(default_factory=SessionConfig)
    max_body: int = 8 * MIB  # bytes of one request body
    max_sessions: int = 8  # live /v1/sessions sessions
    max_running: int = 16  # requests in one engine's running batch (each step feeds them all)
    max_waiting: int = 64  # completions in flight beyond max_running (over all engines); more get 429
    token_budget: int | None = 256  # tokens one step feeds over all requests: long prompts prefill in chunks
    pool_pages: int | None = None  # pages per layer in an engine's pool; None: max_running requests of the
    # default cache, and at least --max-cache-tokens
    max_pools: int = 4  # engines (pools) at once, one per cache layout (page size, dtype) requests ask for
    drain_seconds: float = 10.0  # on SIGTERM: how long in-flight requests may go on before they end ("abort")
    kv_events_endpoint: str | None = None  # publish the prefix caches as vLLM KV events (ZMQ PUB) here
    kv_events_replay: str | None = None  # and answer replay requests (ZMQ ROUTER) here
    kv_events_topic: str = ""
    max_session_tokens: int = 2048  # prompt + generated tokens of one session
    max_cache_tokens: int = 4096  # page_size * max_pages of one session's cache (per layer)
    max_session_mib: int = 256  # memory of one session's KV caches and step snapshots (estimated up front)
    idle_timeout: float = 600.0  # seconds a session may sit unused before it is deleted
    workers: int = 2  # worker threads for /v1/attention, prompt encoding and answers (decoding is the engine's)
    expiry_interval: float = 5.0  # seconds between sweeps for idle sessions

    def __post_init__(self) -> None:
        check_int("max_body", self.max_body, 1024, 1 << 30)
        check_int("max_sessions", self.max_sessions, 1, 1024)
        check_int("max_running", self.max_running, 1, 256)
        check_int("max_waiting", self.max_waiting, 0, 1 << 16)
        check_int("max_pools", self.max_pools, 1, 64)
        if self.token_budget is not None:
            check_int("token_budget", self.token_budget, 1, 1 << 20)
        if self.pool_pages is not None:
            check_int("pool_pages", self.pool_pages, 1, 1 << 20)
        check_int("max_session_tokens", self.max_session_tokens, 2, 1 << 20)
        check_int("max_cache_tokens", self.max_cache_tokens, 1, 1 << 20)
        check_int("workers", self.workers, 1, 64)
        check_int("max_session_mib", self.max_session_mib, 1, 1 << 20)

    @property
    def max_session_bytes(self) -> int:
        return self.max_session_mib * MIB

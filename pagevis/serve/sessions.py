"""Decoding sessions the server keeps: built from request settings exactly as the CLI builds them from
flags (both through the settings table), bounded in number and size, expired when idle, stepped by one
request at a time. Each lives in its layout's shared engine as a request that pauses between calls (see
core.py); its records show only its own pages (session_pages.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace

from pagevis import settings as table
from pagevis.engine import DecodeSession, SessionConfig
from pagevis.engine.session_config import encode_prompt
from pagevis.kvcache import ConfigError
from pagevis.model.chat_template import ChatTemplateError
from pagevis.serve.errors import ApiError
from pagevis.serve.session_pages import OwnPages
from pagevis.serve.settings import ServeSettings


def session_config(settings: ServeSettings, fields: dict) -> SessionConfig:
    """The SessionConfig `pagevis run` would build from the same settings: a request's fields (named as the
    flags, e.g. `max_tokens`, `sample`; None = not set) over the server's defaults (`pagevis serve
    --page-size ...`), through the settings table's apply() as the command line's flags; ConfigError names
    the bad one. A request naming no max_pages gets the server's full cache (ServeSettings.full_cache)."""
    config = table.apply(settings.defaults, fields)
    table.setting("page_size").check(config.page_size)
    if settings.full_cache and fields.get("max_pages") is None:
        config = replace(config, max_pages=settings.full_cache_pages(config.page_size))
    config.check()
    capacity = config.ram_tokens
    if capacity > settings.max_cache_tokens:
        raise ConfigError("max_pages", config.max_pages,
                          f"at most {max(settings.max_cache_tokens // config.page_size, 0)} pages of "
                          f"{config.page_size} tokens (this server's --max-cache-tokens "
                          f"{settings.max_cache_tokens})")
    return config


def snapshot_bytes_per_step(session: DecodeSession) -> int:
    """What one StepRecord of this session holds: per layer and slot a position (int32), a protected flag and
    a score (float32); float16 attention of each recorded layer's heads; about 200 bytes of events and
    block table per layer."""
    cfg = session.cache_config
    return cfg.n_layers * cfg.capacity * 9 + len(session.record_layers) * cfg.n_heads * cfg.capacity * 2 + \
        cfg.n_layers * 200


def check_tokens(settings: ServeSettings, prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt + generated tokens within --max-session-tokens; ConfigError naming the field."""
    limit = settings.max_session_tokens
    if prompt_tokens >= limit:
        raise ConfigError("prompt", f"{prompt_tokens} tokens",
                          f"at most {limit - 1} tokens (this server's --max-session-tokens {limit})")
    if prompt_tokens + max_new_tokens > limit:
        raise ConfigError("max_new_tokens", max_new_tokens,
                          f"at most {limit - prompt_tokens} after this {prompt_tokens}-token prompt "
                          f"(this server's --max-session-tokens {limit})")


def build_session(model, settings: ServeSettings, prompt: str, config: SessionConfig,
                  prompt_ids: list[int] | None = None, engine=None, fit: bool = False) -> DecodeSession:
    """A DecodeSession within the server's bounds: prompt + generated tokens, and the memory it will take
    (its oracle's KV cache and its step snapshots: at most one step per prompt token plus one per generated
    token). With `fit` (a full cache the request did not size) its cache holds just its prompt and max_tokens:
    every step snapshot is as large as the cache. In `engine` (shared), not yet submitted: the engine's
    thread submits it on its first step. Runs in a worker thread: encoding a long prompt takes a while."""
    if model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so it cannot take text prompts", param="prompt")
    try:
        prompt_ids = prompt_ids or encode_prompt(model, prompt, config.chat, config.special)
    except ChatTemplateError as error:  # the prompt, in the model's chat template
        raise ApiError(422, f"prompt: {error}", param="prompt", code="chat_template") from None
    check_tokens(settings, len(prompt_ids), config.max_new_tokens)
    if fit:
        needed = -(-(len(prompt_ids) + config.max_new_tokens) // config.page_size)
        config = replace(config, max_pages=max(1, min(config.max_pages, needed)))
    pool = None if engine is None else OwnPages(config.cache_config(model.config), engine.cache.pool_pages)
    session = DecodeSession(model, prompt, config, prompt_ids=prompt_ids, engine=engine, pool=pool)
    per_step = snapshot_bytes_per_step(session)
    steps = len(session.prompt_ids) + config.max_new_tokens
    caches = session.cache_config.total_bytes() + (session.oracle.cache.config.total_bytes() if session.oracle else 0)
    if caches + steps * per_step > settings.max_session_bytes:
        room = (settings.max_session_bytes - caches) // per_step - len(session.prompt_ids)
        raise ConfigError("max_new_tokens", config.max_new_tokens,
                          f"at most {max(room, 0)} with this prompt and cache: its KV cache{'s' if session.oracle else ''} "
                          f"take {caches >> 20} MiB, each step keeps {per_step / 1024:.0f} KiB of snapshots, and "
                          f"this server allows {settings.max_session_mib} MiB per session (--max-session-mib); "
                          "record_layers \"none\" or a smaller cache keep less")
    return session


@dataclass
class ServedSession:
    id: str
    session: DecodeSession
    core: object  # the EngineCore it lives in
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time steps or reads it
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    decoder: object = None  # the tokenizer's incremental decoder: text of new tokens as they come

    def __post_init__(self) -> None:
        self.decoder = self.session.model.tokenizer.incremental_decoder()

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionStore:
    """Sessions by id, and the slots they hold (at most max_sessions). Used from the event loop thread only,
    so its bookkeeping needs no lock."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.sessions: dict[str, ServedSession] = {}
        self.slots_used = 0

    def take_slot(self) -> None:
        if self.slots_used >= self.settings.max_sessions:
            raise ApiError(429, f"this server already runs {self.settings.max_sessions} sessions (its "
                                f"--max-sessions); delete one (DELETE /v1/sessions/ID) or wait until one idles out "
                                f"({self.settings.idle_timeout:g} s)", code="too_many_sessions")
        self.slots_used += 1

    def give_slot(self) -> None:
        self.slots_used -= 1

    def add(self, session: DecodeSession, core) -> ServedSession:
        """Keep a session built after take_slot(); it holds that slot until deleted."""
        served = ServedSession(f"sess-{secrets.token_hex(8)}", session, core)
        self.sessions[served.id] = served
        core.holders += 1  # its pool stays while it lives
        return served

    def get(self, session_id: str) -> ServedSession:
        served = self.sessions.get(session_id)
        if served is None:
            raise ApiError(404, f"no session {session_id!r} (it may have been deleted or expired after "
                                f"{self.settings.idle_timeout:g} s idle)", param="session_id", code="session_not_found")
        return served

    def remove(self, served: ServedSession) -> None:
        if self.sessions.pop(served.id, None) is not None:
            served.core.call(served.core.close_session, served.session)  # its pages go back to the pool
            served.core.holders -= 1
            self.give_slot()

    def expire(self, now: float | None = None) -> list[str]:
        """Delete sessions idle longer than idle_timeout (never one a request is using)."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self.sessions.values()
                if not s.lock.locked() and now - s.last_used > self.settings.idle_timeout]
        for served in idle:
            self.remove(served)
        return [s.id for s in idle]

    def close(self) -> None:
        for served in list(self.sessions.values()):
            self.remove(served)

"""The server's engines: one per cache layout, and admission to them.

Requests whose pages are alike share one engine, one pool and one batch. A page's shape is the layout:
its page size and storage dtype (and, with the server's disk tier, the RAM frames, max_pages, that every
request's pages pass through). A request that asks for another layout gets an engine of its own (created
on first use, at most --max-pools at once; an idle one makes way for a new layout, and if all are busy the
request gets 429). Everything else a request sets stays its own inside a shared pool: its eviction policy
and parameters, its budget (max_pages: the tokens it may hold), sampling, max_tokens.

Admission: at most --max-running requests run in one engine's batch; completions in flight (running or
waiting) over the whole server are bounded by --max-running + --max-waiting, beyond which a request gets 429
with Retry-After. Sessions are bounded by --max-sessions. While the server drains (SIGTERM) every new request
gets 503.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pagevis.engine import Engine
from pagevis.engine.batch import BatchConfig
from pagevis.kvcache import ConfigError
from pagevis.serve.core import EngineCore
from pagevis.serve.errors import ApiError

RETRY_AFTER_SECONDS = 1


class Engines:
    """Engine cores by layout, and the count of completions in flight. Used from the event loop thread."""

    def __init__(self, settings, model, metrics) -> None:
        self.settings, self.model, self.metrics = settings, model, metrics
        self.cores: dict[tuple, EngineCore] = {}
        self.in_flight = 0
        self.draining = False
        self.kv_events = None
        if settings.kv_events_endpoint:
            from pagevis.serve.kv_events import KVEvents

            self.kv_events = KVEvents(settings.kv_events_endpoint, settings.kv_events_replay,
                                      settings.kv_events_topic)

    @staticmethod
    def layout(config) -> tuple:
        """What requests must share to share a pool (int4 / int2: the residual window is part of the layout; ThinK's
        share of key channels pruned is the pool's, each sequence choosing its own channels)."""
        return (config.page_size, config.dtype, config.residual if config.has_residual else None,
                config.max_pages if config.tiered else None, config.key_channels)

    def core(self, config) -> EngineCore:
        """The engine for this request's layout (made now if there is none); ConfigError when the request's
        budget is more than the pool holds."""
        self._check_open()
        key = self.layout(config)
        core = self.cores.get(key)
        if core is None:
            if len(self.cores) >= self.settings.max_pools:
                idle = next((k for k, c in self.cores.items() if not c.busy), None)
                if idle is None:
                    raise ApiError(429, f"this server already runs {len(self.cores)} pools, all busy (its "
                                        f"--max-pools); use the page size and dtype of one of them "
                                        f"({self._layouts()}) or retry later", param="page_size",
                                   code="too_many_pools", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                self._close(idle)
            core = self._start(key, config)
        pool = core.engine.cache.pool_pages
        if config.n_page_ids > pool:
            field = "disk_pages" if config.tiered else "max_pages"
            raise ConfigError(field, getattr(config, field), f"at most {pool} pages: this server's pool holds "
                                                             f"{pool} pages of {config.page_size} (--pool-pages)")
        return core

    def _start(self, key: tuple, config) -> EngineCore:
        defaults = self.settings.defaults
        pool_config = dataclasses.replace(defaults, page_size=config.page_size, dtype=config.dtype,
                                          residual=config.residual, key_channels=config.key_channels,
                                          max_pages=config.max_pages if config.tiered else defaults.max_pages)
        batch = BatchConfig(max_seqs=self.settings.max_seqs, pool_pages=self.settings.pool_pages_for(config.page_size),
                            token_budget=self.settings.token_budget, int8_rows=self.settings.int8_rows)
        engine = Engine(self.model, pool_config, batch, max_chunk=self.settings.max_chunk)
        engine.cache.take_memory()  # the pool's memory, taken now (as vLLM's): RSS is flat from the start
        if self.kv_events is not None:
            self.kv_events.watch(engine)
        name = (f"{config.page_size}x{config.dtype}" + (f"x{config.max_pages}" if config.tiered else "")
                + (f"-think{config.key_channels:g}" if config.key_channels else ""))
        core = EngineCore(engine, name, self.metrics.observe_engine(name))
        self.cores[key] = core
        return core

    def _close(self, key: tuple) -> None:
        core = self.cores.pop(key)
        if self.kv_events is not None:
            core.call(self.kv_events.closing, core.engine).result(30)
        core.close()
        self.metrics.forget_engine(core.observer)

    def _layouts(self) -> str:
        return ", ".join(f"page_size {k[0]} dtype {k[1]}" for k in self.cores)

    def _check_open(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")

    # --- completions in flight -------------------------------------------------------------------
    @property
    def max_in_flight(self) -> int:
        return self.settings.max_seqs + self.settings.max_waiting

    def take(self) -> None:
        self._check_open()
        if self.in_flight >= self.max_in_flight:
            raise ApiError(429, f"this server already has {self.in_flight} requests in flight (its --max-running "
                                f"{self.settings.max_seqs} + --max-waiting {self.settings.max_waiting}); retry "
                                "later", code="too_many_requests", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.in_flight += 1

    def give(self) -> None:
        self.in_flight -= 1

    # --- state -----------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        observers = [c.observer for c in self.cores.values()]
        return {"running": sum(o.running for o in observers), "waiting": sum(o.waiting for o in observers),
                "paused": sum(o.paused_requests for o in observers), "pools": len(self.cores)}

    async def drain(self, seconds: float) -> None:
        """Stop admitting; let requests in flight go on for `seconds`, then end every one ("abort")."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for core in self.cores.values():
            live = await core.run(lambda c=core: [s for s, r in c.engine.requests.items() if not r.done])
            await core.run(core.cancel, live, "abort")

    def close(self) -> None:
        for key in list(self.cores):
            self._close(key)
        if self.kv_events is not None:
            self.kv_events.close()

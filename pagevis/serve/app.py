"""The FastAPI application: routes, limits, metrics, the engines every request decodes in (engines.py), and
the uvicorn server that drains them on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import time

import anyio
import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagevis import __version__
from pagevis.observe import Metrics
from pagevis.serve import attention_api, openai_api, session_api, tokenize_api
from pagevis.serve.engines import Engines
from pagevis.serve.errors import CheckedRoute, install_handlers
from pagevis.serve.middleware import BodyLimit, RequestCounter
from pagevis.serve.sessions import SessionStore
from pagevis.serve.settings import ServeSettings
from pagevis.serve.worker import in_worker

DESCRIPTION = """The paged-attention engine and decoding sessions of pagevis over HTTP.

* `POST /v1/attention`: attend a query over keys and values written into a page pool.
* `/v1/sessions`: decode step by step and read the cache's block tables, residency and events.
* `/v1/completions`, `/v1/chat/completions`, `/v1/models`: OpenAI-compatible (plain and streamed), with
  log-probabilities (`logprobs`, `echo`: the prompt's, through the request's own cache).
* `/tokenize`, `/detokenize`, `/tokenizer_info`: vLLM's tokenizer endpoints (lm-eval's remote tokenizer).
* `GET /metrics`: Prometheus metrics; `GET /healthz`: liveness.

Every completion and session is a request in one shared engine per cache layout: continuous batching and
one prefix cache over all of them.
"""


def model_id(spec) -> str:
    """The name clients pass as `model`: SmolLM2-135M-Instruct, synthetic, or the GGUF file's stem."""
    if spec.kind == "gguf":
        import os

        return os.path.splitext(os.path.basename(spec.path))[0]
    return "synthetic" if spec.kind == "synthetic" else spec.label


def create_app(settings: ServeSettings | None = None, model=None) -> FastAPI:
    """The app for `settings` (its model is loaded here unless given)."""
    settings = settings or ServeSettings()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.limiter = anyio.CapacityLimiter(settings.workers)
        sweeper = asyncio.create_task(_expire_idle(app.state.store, settings.expiry_interval))
        try:
            yield
        finally:
            sweeper.cancel()
            app.state.store.close()
            await asyncio.to_thread(app.state.engines.close)
            if app.state.request_log is not None:
                app.state.request_log.close()

    app = FastAPI(title="pagevis", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.router.route_class = CheckedRoute
    app.state.settings = settings
    app.state.model = model if model is not None else settings.model_spec.load()
    app.state.model_id = model_id(settings.model_spec)
    app.state.metrics = metrics
    app.state.store = store = SessionStore(settings)
    app.state.engines = engines = Engines(settings, app.state.model, metrics)
    app.state.request_log = None
    if settings.request_log:
        from pagevis.serve.request_log import RequestLog

        app.state.request_log = RequestLog(settings.request_log, settings.kv_events_endpoint)
    metrics.active_sessions.set_function(lambda: len(store.sessions))
    app.state.started = int(time.time())
    install_handlers(app)

    @app.get("/healthz", tags=["service"])
    async def healthz(request: Request) -> dict:
        return {"status": "draining" if engines.draining else "ok", "model": request.app.state.model_id,
                "sessions": len(store.sessions), "slots_used": store.slots_used + engines.in_flight,
                "max_sessions": settings.max_sessions, "in_flight": engines.in_flight, **engines.counts()}

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/attention", tags=["attention"], response_model=attention_api.AttentionResponse,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": attention_api.AttentionRequest.model_json_schema()}}}})
    async def attend(request: Request) -> Response:
        """Write `keys` and `values` into a page pool and attend `query` over them with the engine."""
        body = await request.body()
        return Response(await in_worker(request, attention_api.answer_json, body), media_type="application/json")

    app.include_router(session_api.router)
    app.include_router(openai_api.router)
    app.include_router(tokenize_api.router)
    # Outermost first: count every request (413s included), then refuse oversized bodies unread.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body)
    app.add_middleware(RequestCounter, router=app.router, registry=metrics.registry)
    return app


async def _expire_idle(store: SessionStore, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        store.expire()


class Server(uvicorn.Server):
    """uvicorn's server, draining the engines first when it is told to stop (SIGTERM, SIGINT, should_exit):
    it stops listening, lets requests in flight go on for --drain-seconds, ends the rest (finish_reason
    "abort", so every stream ends properly), then shuts down as uvicorn does."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.engines, self.drain_seconds = app.state.engines, app.state.settings.drain_seconds

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        await self.engines.drain(self.drain_seconds)
        await super().shutdown(sockets)

"""The FastAPI application: routes, limits, metrics, and the worker pool decoding runs in."""

from __future__ import annotations

import asyncio
import contextlib
import time

import anyio
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from ..observe import Metrics
from . import attention, openai_api, session_api
from .errors import install_handlers
from .middleware import BodyLimit, RequestCounter
from .sessions import SessionStore
from .settings import ServeSettings
from .worker import in_worker

DESCRIPTION = """The paged-attention engine and decoding sessions of pagevis over HTTP.

* `POST /v1/attention`: attend a query over keys and values written into a page pool.
* `/v1/sessions`: decode step by step and read the cache's block tables, residency and events.
* `/v1/completions`, `/v1/chat/completions`, `/v1/models`: OpenAI-compatible (plain and streamed).
* `GET /metrics`: Prometheus metrics; `GET /healthz`: liveness.
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

    app = FastAPI(title="pagevis", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.model = model if model is not None else settings.model_spec.load()
    app.state.model_id = model_id(settings.model_spec)
    app.state.metrics = metrics
    app.state.store = SessionStore(settings, metrics)
    app.state.started = int(time.time())
    install_handlers(app)

    @app.get("/healthz", tags=["service"])
    async def healthz(request: Request) -> dict:
        store = request.app.state.store
        return {"status": "ok", "model": request.app.state.model_id, "sessions": len(store.sessions),
                "slots_used": store.slots_used, "max_sessions": settings.max_sessions}

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/attention", tags=["attention"], response_model=attention.AttentionResponse,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": attention.AttentionRequest.model_json_schema()}}}})
    async def attend(request: Request) -> Response:
        """Write `keys` and `values` into a page pool and attend `query` over them with the engine."""
        body = await request.body()
        return Response(await in_worker(request, attention.answer_json, body), media_type="application/json")

    app.include_router(session_api.router)
    app.include_router(openai_api.router)
    # Outermost first: count every request (413s included), then refuse oversized bodies unread.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body)
    app.add_middleware(RequestCounter, router=app.router, registry=metrics.registry)
    return app


async def _expire_idle(store: SessionStore, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        store.expire()

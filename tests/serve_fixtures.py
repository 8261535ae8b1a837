"""A real uvicorn server on a free loopback port, in a thread, started and stopped by the test."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import httpx

from pagevis.engine import ModelSpec
from pagevis.serve.background import serving
from pagevis.serve.settings import ServeSettings

SYNTH = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3)


@dataclass
class Running:
    url: str
    app: object
    client: httpx.Client
    server: object = None

    def metrics_text(self) -> str:
        return self.client.get("/metrics").text


@contextlib.contextmanager
def running_server(settings: ServeSettings | None = None, model=None, **limits):
    settings = settings or ServeSettings(model_spec=SYNTH, **limits)
    with serving(settings, model) as (url, app, server), httpx.Client(base_url=url, timeout=60) as client:
        yield Running(url, app, client, server)

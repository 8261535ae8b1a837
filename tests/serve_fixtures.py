"""A real uvicorn server on a free loopback port, in a thread, started and stopped by the test."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from pagevis.engine import ModelSpec
from pagevis.serve.app import Server, create_app
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
    app = create_app(settings, model)
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield Running(url, app, client, server)
    finally:
        server.should_exit = True
        thread.join(timeout=20)

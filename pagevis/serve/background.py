"""`pagevis serve` inside another program: the real uvicorn server on a free loopback port, in a thread,
started and stopped by its caller (`pagevis eval` points lm-eval at it; the tests call it too)."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from pagevis.serve.app import Server, create_app
from pagevis.serve.settings import ServeSettings

START_SECONDS = 20.0  # how long uvicorn may take to start listening


@contextlib.contextmanager
def serving(settings: ServeSettings, model=None):
    """Yield (base URL, the app, the server) while the server runs; drain and stop it on exit."""
    app = create_app(settings, model)
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), app)
    thread = threading.Thread(target=server.run, name="pagevis-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(timeout=START_SECONDS)

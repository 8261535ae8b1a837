"""The server's limits as a client meets them: an oversized body is a 413 httpx receives (not a reset), 429 with
Retry-After beyond the queue, pools per cache layout (and 422 / 429 naming the field when a request cannot
have one), and shutdown: admission stops, streams in flight end with finish_reason "abort", nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_fixtures import SYNTH, running_server

from pagevis.serve.settings import ServeSettings

MIB = 1 << 20


def test_an_oversized_body_reaches_httpx_as_a_413():
    with running_server(max_body=MIB) as running:
        big = b'{"query": [' + b"1.0, " * (9 * MIB // 5) + b"1.0]}"  # 9 MiB, Content-Length known
        answer = running.client.post("/v1/attention", content=big, headers={"content-type": "application/json"})
        assert answer.status_code == 413
        assert f"over the limit of {MIB} bytes" in answer.json()["error"]["message"]

        def chunks():  # 9 MiB, chunked: no Content-Length
            for _ in range(9 * 16):
                yield b"1.0, " * (MIB // 80)

        streamed = running.client.post("/v1/attention", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert running.client.get("/healthz").json()["status"] == "ok"


def stream_lines(url: str, body: dict, lines: list, started: threading.Event | None = None) -> None:
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if started is not None:
                    started.set()


def test_beyond_the_queue_is_429_with_retry_after():
    with running_server(max_seqs=1, max_waiting=1, drain_seconds=0.2) as running:
        body = {"model": "synthetic", "prompt": "abc", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        outputs = [[], []]
        streams = []
        for output in outputs:
            started = threading.Event()
            streams.append(threading.Thread(target=stream_lines, args=(running.url, body, output, started)))
            streams[-1].start()
            if len(streams) == 1:
                assert started.wait(30)
        deadline = time.monotonic() + 30
        def queued():  # the second request has reached the engine's waiting queue (commands run between steps)
            health = running.client.get("/healthz").json()
            return health["in_flight"] >= 2 and health["waiting"] >= 1

        while not queued() and time.monotonic() < deadline:
            time.sleep(0.02)
        health = running.client.get("/healthz").json()
        assert (health["running"], health["waiting"]) == (1, 1)
        refused = running.client.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
    for stream in streams:  # the server drained: both streams ended properly
        stream.join(30)
    assert all(json.loads(o[-2][6:])["choices"][0]["finish_reason"] in ("length", "abort") for o in outputs)


def test_each_cache_layout_gets_a_pool_and_a_budget_must_fit_it():
    with running_server(max_pools=2, pool_pages=64) as running:
        c = running.client

        def complete(**cache):
            return c.post("/v1/completions", json={"model": "synthetic", "prompt": "abc", "max_tokens": 3,
                                                   "pagevis": cache})

        assert complete(page_size=4).status_code == 200
        assert complete(page_size=8, policy="h2o", max_pages=3).status_code == 200  # policy, budget: per request
        assert complete(page_size=4, dtype="float16").status_code == 200  # a third layout: an idle pool makes way
        assert running.client.get("/healthz").json()["pools"] == 2
        too_big = complete(page_size=4, max_pages=65)
        assert too_big.status_code == 422
        error = too_big.json()["error"]
        assert error["param"] == "max_pages" and "at most 64 pages" in error["message"], error


def test_a_third_layout_while_two_pools_are_busy_is_429():
    # the two streams must outlast the third request: the synthetic model decodes ~1,500 tokens/s, so 400 tokens
    # (0.3 s) sometimes ended first on a loaded machine; 2,000 (its context is 2,048) keep both pools busy longer
    with running_server(max_pools=2) as running:
        body = {"model": "synthetic", "prompt": "abc", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        outputs, threads = [[], []], []
        for i, page_size in enumerate((4, 8)):
            started = threading.Event()
            threads.append(threading.Thread(target=stream_lines, args=(
                running.url, {**body, "pagevis": {"page_size": page_size}}, outputs[i], started)))
            threads[-1].start()
            started.wait(30)
        refused = running.client.post("/v1/completions", json={**body, "stream": False, "pagevis": {"page_size": 2}})
        assert refused.status_code == 429 and refused.json()["error"]["param"] == "page_size"
        assert "--max-pools" in refused.json()["error"]["message"]
        for thread in threads:
            thread.join(60)


def test_shutdown_drains_then_aborts_streams_and_refuses_new_requests():
    # The drain must end before the request would: the synthetic model decodes ~1,500 tokens/s here since this
    # round's engine work (1,500 tokens once finished inside a 0.5 s drain: finish_reason "length"), so 2,000 tokens
    # (its context is 2,048) against a 0.1 s drain
    settings = ServeSettings(model_spec=SYNTH, drain_seconds=0.1)
    with running_server(settings) as running:
        body = {"model": "synthetic", "prompt": "abc", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        lines: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=stream_lines, args=(running.url, body, lines, started))
        stream.start()
        started.wait(30)
        began = time.monotonic()
        running.server.should_exit = True  # what SIGTERM does
        stream.join(30)
        assert not stream.is_alive() and time.monotonic() - began < 10
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        with pytest.raises(httpx.HTTPError):
            httpx.post(running.url + "/v1/completions", json={**body, "stream": False}, timeout=5)


@pytest.mark.slow
def test_sigterm_ends_pagevis_serve_within_its_bound():
    """A real `pagevis serve` process: SIGTERM while a stream is in flight; the stream ends with "abort" and
    the process exits within --drain-seconds plus a few seconds. The drain (0.2 s) is far shorter than the
    request (2,000 tokens at ~1,500 tokens/s), so the stream is in flight when it ends."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "pagevis", "serve", "--model", "synthetic", "--port", str(port),
                                "--drain-seconds", "0.2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        lines: list[str] = []
        started = threading.Event()
        body = {"model": "synthetic", "prompt": "abc", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        stream = threading.Thread(target=stream_lines, args=(url, body, lines, started))
        stream.start()
        assert started.wait(30)
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then raises the signal it caught again: the process ends by SIGTERM, drained
        assert process.wait(timeout=20) in (0, -signal.SIGTERM)
        stream.join(10)
        assert time.monotonic() - began < 1 + 8
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines if line.startswith("data: {")]
        assert finish[-1] == "abort" and lines[-1] == "data: [DONE]"
    finally:
        if process.poll() is None:
            process.kill()


def test_a_pool_with_a_session_is_never_closed_for_another_layout():
    with running_server(max_pools=1) as running:
        sid = running.client.post("/v1/sessions", json={"prompt": "a", "page_size": 4, "max_tokens": 5}).json()["id"]
        other = running.client.post("/v1/completions", json={"model": "synthetic", "prompt": "b", "max_tokens": 2,
                                                              "pagevis": {"page_size": 8}})
        assert other.status_code == 429 and other.json()["error"]["param"] == "page_size"
        assert running.client.post(f"/v1/sessions/{sid}/step", json={"n": 100}).json()["done"]
        running.client.delete(f"/v1/sessions/{sid}")
        deadline = time.monotonic() + 10  # the engine thread forgets the session between steps: retry until then
        while True:
            again = running.client.post("/v1/completions", json={"model": "synthetic", "prompt": "b",
                                                                  "max_tokens": 2, "pagevis": {"page_size": 8}})
            if again.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(float(again.headers["retry-after"]) / 10)
        assert again.status_code == 200  # the session gone, its idle pool made way

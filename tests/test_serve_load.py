"""Metrics scraped from /metrics match what clients received; a bounded load on loopback (8 clients x 20
steps, 200 malformed requests) gets no 5xx, a 4xx with a message for every malformed request, and leaves
the server healthy."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import running_server


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_what_clients_received():
    with running_server(max_sessions=4) as running:
        c = running.client
        sid = c.post("/v1/sessions", json={"prompt": "hi", "chat": False, "page_size": 4, "max_pages": 4,
                                           "policy": "h2o", "max_tokens": 25}).json()["id"]
        steps, done, step_requests = [], False, 0
        while not done:
            step_requests += 1
            answer = c.post(f"/v1/sessions/{sid}/step", json={"n": 4}).json()
            steps += answer["steps"]
            done = answer["done"]
            if step_requests == 2:  # paused between calls, the session holds its pages in the pool
                pool = next(iter(running.app.state.engines.cores.values())).engine.cache.pool_pages
                usage = value(scrape(running.metrics_text()), "pagevis_kv_cache_usage_ratio")
                assert usage == answer["pages_used"] / pool > 0
        completion = c.post("/v1/completions", json={"model": "synthetic", "prompt": "abc", "max_tokens": 7,
                                                     "temperature": 0}).json()
        samples = scrape(running.metrics_text())
        received = sum(1 for s in steps if s["next_token"] >= 0) + completion["usage"]["completion_tokens"]
        assert value(samples, "pagevis_generation_tokens_total") == received == 25 + 7
        decode_steps = sum(1 for s in steps if s["kind"] == "decode") + 7 - 1
        assert value(samples, "pagevis_inter_token_latency_seconds_count") == decode_steps
        assert value(samples, "pagevis_time_to_first_token_seconds_count") == 2
        prompt = c.get(f"/v1/sessions/{sid}").json()["prompt_tokens"] + completion["usage"]["prompt_tokens"]
        assert value(samples, "pagevis_prompt_tokens_total") == prompt
        evicted = sum(s["evictions"] for s in steps)
        assert evicted > 0 and value(samples, "pagevis_evictions_total", policy="h2o") == evicted
        assert value(samples, "pagevis_cache_events_total", kind="evict") == evicted
        assert value(samples, "pagevis_active_sessions") == 1  # the session; the completion has finished
        assert value(samples, "pagevis_kv_cache_usage_ratio") == 0  # both finished: their pages are free
        assert value(samples, "pagevis_http_requests_total", route="/v1/sessions/{session_id}/step",
                     method="POST", status="200") == step_requests
        assert value(samples, "pagevis_http_request_duration_seconds_count",
                     route="/v1/sessions/{session_id}/step") == step_requests
        assert not [k for k in samples if "sess-" in str(k)], "raw paths must not become labels"
        c.delete(f"/v1/sessions/{sid}")
        samples = scrape(running.metrics_text())
        assert value(samples, "pagevis_active_sessions") == 0 and value(samples, "pagevis_kv_cache_usage_ratio") == 0


MALFORMED = [
    ("POST", "/v1/attention", {"query": [1.0], "keys": [[1.0], [1.0, 2.0]], "values": [[1.0], [1.0]]}),
    ("POST", "/v1/attention", {"query": "one", "keys": [[1.0]], "values": [[1.0]]}),
    ("POST", "/v1/attention", {"query": [[1.0]] * 3, "keys": [[[1.0]] * 2], "values": [[[1.0]] * 2]}),
    ("POST", "/v1/attention", b'{"query": [NaN], "keys": [[1.0]], "values": [[1.0]]}'),
    ("POST", "/v1/attention", b'{"query": [1.0], "keys": [[1.0]], "values": [[1.0]'),
    ("POST", "/v1/attention", b"\xff\xfe not json"),
    ("POST", "/v1/sessions", {"prompt": "x", "page_size": -3}),
    ("POST", "/v1/sessions", {"prompt": "x", "policy_params": {"n_sink": "many"}}),
    ("POST", "/v1/sessions", {"prompt": 12}),
    ("POST", "/v1/sessions/sess-missing/step", {"n": 1}),
    ("POST", "/v1/sessions/sess-missing/step", {"n": 0}),
    ("GET", "/v1/sessions/sess-missing", None),
    ("DELETE", "/v1/sessions/sess-missing", None),
    ("POST", "/v1/completions", {"model": "synthetic", "prompt": "x", "max_tokens": -1}),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
    ("POST", "/v1/chat/completions", {"model": "synthetic", "messages": []}),
    ("POST", "/v1/chat/completions", {"model": "synthetic", "messages": [{"role": "robot", "content": "x"}]}),
    ("GET", "/v1/nothing-here", None),
    ("PUT", "/v1/attention", None),
]


@pytest.mark.slow
def test_bounded_load_gets_no_5xx_and_leaves_the_server_healthy():
    with running_server(max_sessions=8) as running:
        local = threading.local()

        def http() -> httpx.Client:  # one keep-alive client per worker thread (a new one costs an SSL context)
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=running.url, timeout=60)
            return local.client

        def client_session(index: int) -> list[int]:
            c = http()
            sid = c.post("/v1/sessions", json={"prompt": f"client {index}", "chat": False, "page_size": 4,
                                               "max_pages": 4, "max_tokens": 40, "policy": "sinks"})
            assert sid.status_code == 201, sid.text
            tokens = []
            for _ in range(20):
                answer = c.post(f"/v1/sessions/{sid.json()['id']}/step", json={"n": 1})
                assert answer.status_code == 200, answer.text
                tokens += answer.json()["tokens"]
            return tokens

        def malformed(index: int) -> tuple[int, str]:
            method, path, body = MALFORMED[index % len(MALFORMED)]
            if isinstance(body, bytes):
                answer = http().request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                answer = http().request(method, path, json=body)
            return answer.status_code, answer.json()["error"]["message"]

        jobs = [("session", i) for i in range(8)] + [("bad", i) for i in range(200)]
        random.Random(0).shuffle(jobs)
        with ThreadPoolExecutor(max_workers=16) as pool:
            futures = [pool.submit(client_session if kind == "session" else malformed, i) for kind, i in jobs]
            results = [(kind, f.result()) for (kind, _), f in zip(jobs, futures)]
        bad = [r for kind, r in results if kind == "bad"]
        assert len(bad) == 200
        assert all(400 <= status < 500 and message for status, message in bad), [b for b in bad if b[0] >= 500]
        received = sum(len(r) for kind, r in results if kind == "session")
        samples = scrape(running.metrics_text())
        assert value(samples, "pagevis_generation_tokens_total") == received
        assert not any(name == "pagevis_http_requests_total" and dict(labels)["status"].startswith("5")
                       for (name, labels) in samples)
        health = running.client.get("/healthz").json()
        assert health["status"] == "ok" and health["sessions"] == 8
        assert running.client.post("/v1/attention", json={"query": [1.0], "keys": [[1.0]],
                                                          "values": [[2.0]]}).json()["output"] == [2.0]


def test_error_bodies_are_json_with_a_message():
    with running_server() as running:
        answer = running.client.post("/v1/attention", content=b"{", headers={"content-type": "application/json"})
        assert answer.status_code == 422
        assert json.loads(answer.text)["error"]["message"]


def test_a_client_leaving_mid_stream_frees_its_pages():
    with running_server(max_seqs=1, max_waiting=0) as running:
        body = {"model": "synthetic", "prompt": "abc", "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.Client(base_url=running.url, timeout=60) as other, \
                other.stream("POST", "/v1/completions", json=body) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            busy = running.client.post("/v1/completions", json={**body, "stream": False})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert "--max-waiting 0" in busy.json()["error"]["message"]
        deadline = time.monotonic() + 20  # the server notices the client left when the stream next writes
        while time.monotonic() < deadline:
            health = running.client.get("/healthz").json()
            if (health["slots_used"], health["running"], health["waiting"]) == (0, 0, 0):
                break
            time.sleep(0.05)
        assert (health["slots_used"], health["running"], health["waiting"]) == (0, 0, 0)
        samples = scrape(running.metrics_text())
        assert value(samples, "pagevis_kv_cache_usage_ratio") == 0
        assert value(samples, "pagevis_generation_tokens_total") < 1500, "decoding stopped with the client"


def test_engine_steps_are_counted_by_their_rows_and_requests_wait_from_their_arrival():
    """pagevis_engine_step_seconds / pagevis_iteration_tokens by mix count every engine step and the rows it fed
    (against the engine's step count and each answer's usage); a request that came while the engine thread was busy
    waited from then (pagevis_request_queue_time_seconds), not from when the thread took it in."""
    body = {"model": "synthetic", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with running_server() as running:
        c = running.client
        c.post("/v1/completions", json={**body, "prompt": "warm"}).raise_for_status()
        core = next(iter(running.app.state.engines.cores.values()))
        before, steps_before = scrape(running.metrics_text()), core.engine.n_steps
        busy = core.call(time.sleep, 0.6)  # the engine thread is busy while the three requests arrive
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: c.post("/v1/completions", json={**body, "prompt": p}).json(),
                                    ("one", "two two", "three three three")))
        busy.result()
        after = scrape(running.metrics_text())

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        mixes = ("decode", "prefill", "mixed")
        counts = {m: delta("pagevis_engine_step_seconds_count", mix=m) for m in mixes}
        assert sum(counts.values()) == core.engine.n_steps - steps_before == 5
        assert counts == {"decode": 4, "prefill": 1, "mixed": 0}  # the three prompts in one step, then 4 x 3 rows
        assert {m: delta("pagevis_iteration_tokens_count", mix=m) for m in mixes} == counts
        fed = [a["usage"]["prompt_tokens"] - a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        assert delta("pagevis_iteration_tokens_sum", mix="prefill") == sum(fed)
        assert delta("pagevis_iteration_tokens_sum", mix="decode") == 3 * 4
        assert delta("pagevis_engine_step_seconds_sum", mix="decode") > 0
        assert delta("pagevis_request_queue_time_seconds_count") == 3
        assert delta("pagevis_request_queue_time_seconds_sum") > 3 * 0.3  # each waited out most of the sleep


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_the_server_runs_on_uvloop_and_httptools():
    """pyproject installs uvicorn's fast event loop and HTTP parser, and the server takes them: asyncio's wake-up of
    the loop let go of the engine thread's GIL between steps (docs/serving.md). (A checkout whose .venv predates them
    skips the server half until `make install`.)"""
    with open(Path(__file__).parent.parent / "pyproject.toml", "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    assert any(d.startswith("uvloop") for d in dependencies) and any(d.startswith("httptools") for d in dependencies)
    if importlib.util.find_spec("uvloop") is None or importlib.util.find_spec("httptools") is None:
        pytest.skip("uvloop or httptools is not installed here: run make install")
    with running_server() as running:
        assert type(running.server.servers[0]).__module__.startswith("uvloop")
        assert running.server.config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
        with running.client.stream("POST", "/v1/completions", json={
                "model": "synthetic", "prompt": "abc", "max_tokens": 4, "stream": True}) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2

"""pagevis serve over real HTTP: the attention endpoint against float64 NumPy, sessions against DecodeSession
and `pagevis run`, errors (422 naming the field, 404, 409, 413, 429), expiry, and the non-loopback refusal."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import numpy as np
import pytest
from serve_fixtures import SYNTH, running_server

from pagevis.cli.main import main
from pagevis.engine import DecodeSession, SamplingConfig
from pagevis.serve.settings import serve_defaults
from pagevis.trace import read_trace, record_differences


@pytest.fixture(scope="module")
def server():
    with running_server(max_sessions=8) as running:
        yield running


def dense_reference(q, k, v):
    """float64 softmax(q k^T / sqrt(d)) v per query head; query head h reads KV head h // group."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    n_heads, d = q.shape
    group = n_heads // k.shape[1]
    out, weights = np.zeros_like(q), np.zeros((n_heads, k.shape[0]))
    for h in range(n_heads):
        scores = k[:, h // group] @ q[h] / math.sqrt(d)
        w = np.exp(scores - scores.max())
        weights[h] = w / w.sum()
        out[h] = weights[h] @ v[:, h // group]
    return out, weights


# --- /v1/attention ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads, n_kv, n_keys, page_size", [(None, None, 37, 4), (6, 2, 50, 16), (3, 3, 1, 8)])
def test_attention_equals_float64_reference(server, n_heads, n_kv, n_keys, page_size):
    rng = np.random.default_rng(n_keys)
    d = 8
    if n_heads is None:  # a single head: (d,), (T, d)
        q, k, v = rng.normal(size=d), rng.normal(size=(n_keys, d)), rng.normal(size=(n_keys, d))
    else:
        q, k, v = rng.normal(size=(n_heads, d)), rng.normal(size=(n_keys, n_kv, d)), rng.normal(size=(n_keys, n_kv, d))
    answer = server.client.post("/v1/attention", json={"query": q.tolist(), "keys": k.tolist(), "values": v.tolist(),
                                                      "page_size": page_size, "return_weights": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected, weights = dense_reference(q.reshape(-1, d), k.reshape(n_keys, -1, d), v.reshape(n_keys, -1, d))
    output = np.array(body["output"])
    assert output.shape == q.shape
    np.testing.assert_allclose(output.reshape(-1, d), expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(body["weights"]).reshape(-1, n_keys), weights, atol=1e-6)
    assert body["pages_used"] == math.ceil(n_keys / page_size)
    assert body["n_keys"] == n_keys


GOOD = {"query": [1.0, 0.0], "keys": [[1.0, 0.0], [0.0, 1.0]], "values": [[1.0, 2.0], [3.0, 4.0]]}


def bad(**changes):
    return {**GOOD, **changes}


BAD_ATTENTION = [
    (bad(keys=[[1.0, 0.0], [0.0]]), "keys[1]", "ragged"),
    (bad(values=[[1.0, 2.0]]), "values", "differs"),
    (bad(query=[1.0, 0.0, 3.0]), "keys", "head dimension"),
    (bad(query=[[1.0, 0.0]] * 3, keys=[[[1.0, 0.0]] * 2] * 2, values=[[[1.0, 0.0]] * 2] * 2), "query", "divide"),
    (bad(query=[[1.0, 0.0]]), "keys", "does not go with"),
    (bad(keys=[[1.0, "x"], [0.0, 1.0]]), "keys[0][1]", "valid number"),
    (bad(keys=[]), "keys", "empty"),
    (bad(page_size=0), "page_size", "greater than or equal to 1"),
    (bad(query=None), "query", ""),
    ({"query": [1.0], "keys": [[1.0]]}, "values", "required"),
    (bad(colour="red"), "colour", "not permitted"),
]


@pytest.mark.parametrize("payload, field, words", BAD_ATTENTION)
def test_attention_rejects_bad_input_naming_the_field(server, payload, field, words):
    answer = server.client.post("/v1/attention", json=payload)
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith(field) and words in message, message
    details = answer.json()["error"].get("details", [])
    assert all(set(d) == {"loc", "msg", "type"} for d in details), "the body must not be echoed"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_attention_rejects_non_finite_numbers(server, literal):
    text = f'{{"query": [1.0, 0.0], "keys": [[1.0, 0.0], [0.0, {literal}]], "values": [[1.0, 2.0], [3.0, 4.0]]}}'
    answer = server.client.post("/v1/attention", content=text, headers={"content-type": "application/json"})
    assert answer.status_code == 422
    assert answer.json()["error"]["message"] == "keys[1][1]: Input should be a finite number"


def test_attention_bounds_the_number_of_keys():
    with running_server(max_body=1 << 24) as running:
        keys = [[0.0]] * 16385
        answer = running.client.post("/v1/attention", json={"query": [1.0], "keys": keys, "values": keys})
        assert answer.status_code == 422
        assert "number of keys T = 16385" in answer.json()["error"]["message"]


def test_bodies_over_the_limit_get_413_unparsed():
    with running_server(max_body=4096) as running:
        big = b'{"query": [' + b"1.0, " * 2000 + b'1.0]}'
        answer = running.client.post("/v1/attention", content=big, headers={"content-type": "application/json"})
        assert answer.status_code == 413
        assert "over the limit of 4096 bytes" in answer.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it streams in
            for _ in range(100):
                yield b"1.0, " * 20

        streamed = running.client.post("/v1/attention", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert running.client.get("/healthz").json()["status"] == "ok"


# --- sessions ---------------------------------------------------------------------------------------

SESSION = {"prompt": "Pages of keys and values.", "page_size": 4, "max_pages": 5, "policy": "h2o",
           "max_tokens": 12, "temperature": 0.9, "seed": 5, "record_layers": [0]}


def direct_session() -> DecodeSession:
    """SESSION as a DecodeSession, on the server's defaults for what SESSION does not set."""
    config = dataclasses.replace(serve_defaults(), page_size=4, max_pages=5, policy="h2o", max_new_tokens=12,
                                 record_layers=(0,), sampling=SamplingConfig(mode="sample", temperature=0.9, seed=5))
    session = DecodeSession(SYNTH.load(), SESSION["prompt"], config)
    list(session.run())
    return session


def test_session_steps_equal_a_direct_decode_session(server, tmp_path):
    created = server.client.post("/v1/sessions", json=SESSION)
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    tokens, text, steps = [], "", 0
    while True:
        answer = server.client.post(f"/v1/sessions/{sid}/step", json={"n": 5}).json()
        tokens += answer["tokens"]
        text += answer["new_text"]
        steps += len(answer["steps"])
        if answer["done"]:
            break
    reference = direct_session()
    assert tokens == reference.generated
    assert text == reference.text() == answer["text"]
    assert steps == len(reference.records)

    state = server.client.get(f"/v1/sessions/{sid}").json()
    last = reference.records[-1]
    assert [layer["block_table"] for layer in state["layers"]] == [list(t) for t in last.block_tables]
    assert state["layers"][1]["resident_positions"] == sorted(int(p) for p in last.slot_maps[1].ravel() if p >= 0)
    assert state["evictions_total"] == last.evictions_total > 0
    assert state["stop_reason"] == "max_new_tokens"

    trace_answer = server.client.get(f"/v1/sessions/{sid}/trace")
    assert trace_answer.headers["content-type"] == "application/zip"
    path = tmp_path / "session.pvtrace"
    path.write_bytes(trace_answer.content)
    trace = read_trace(path)
    assert len(trace.records) == len(reference.records)
    assert all(set(record_differences(a, b)) <= {"timings"} for a, b in zip(trace.records, reference.records))

    again = server.client.post(f"/v1/sessions/{sid}/step", json={"n": 1})
    assert again.status_code == 409 and "finished" in again.json()["error"]["message"]
    assert server.client.delete(f"/v1/sessions/{sid}").json() == {"id": sid, "deleted": True}
    assert server.client.get(f"/v1/sessions/{sid}").status_code == 404


def test_session_text_equals_pagevis_run(server, capsys):
    flags = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--model-seed", "3", "--page-size", "4", "--max-pages", "3", "--policy", "sinks", "--max-tokens", "9",
             "--prompt", "hello there", "--quiet", "--json"]
    assert main(["run", *flags]) == 0
    expected = json.loads(capsys.readouterr().out)
    sid = server.client.post("/v1/sessions", json={"prompt": "hello there", "page_size": 4, "max_pages": 3,
                                                   "policy": "sinks", "max_tokens": 9}).json()["id"]
    answer = server.client.post(f"/v1/sessions/{sid}/step", json={"n": 1000}).json()
    assert answer["text"] == expected["text"]
    assert answer["generated_tokens"] == expected["generated_tokens"]
    assert answer["evictions_total"] == expected["evictions"]
    server.client.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("payload, field, words", [
    ({"prompt": "x", "page_size": 0}, "page_size", "an integer from 1 to"),
    ({"prompt": "x", "policy": "fifo"}, "policy", "one of oldest"),
    ({"prompt": "x", "policy": "sinks", "policy_params": {"n_sink": -1}}, "policy_params.n_sink", ""),
    ({"prompt": "x", "temperature": 0}, "temperature", "(0, 10]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "from 1"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens", "--max-session-tokens"),
    ({"prompt": "x", "page_size": 64, "max_pages": 100}, "max_pages", "--max-cache-tokens"),
    ({"prompt": "x", "page_size": 64, "max_pages": 64, "max_tokens": 1900}, "max_tokens", "--max-session-mib"),
    ({"prompt": "x", "record_layers": [7]}, "record_layers", "from 0 to 1"),
    ({"prompt": "", "chat": False}, "prompt", "at least one token"),
    ({"prompt": "x", "dtype": "int3"}, "dtype", "float32"),
])
def test_session_settings_are_validated_like_the_cli(server, payload, field, words):
    answer = server.client.post("/v1/sessions", json=payload)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and words in error["message"], error
    assert server.client.get("/healthz").json()["slots_used"] == 0, "a refused session must not keep a slot"


def test_unknown_sessions_are_404(server):
    for method, path in (("GET", "/v1/sessions/nope"), ("POST", "/v1/sessions/nope/step"),
                         ("GET", "/v1/sessions/nope/trace"), ("DELETE", "/v1/sessions/nope")):
        answer = server.client.request(method, path, json={"n": 1} if method == "POST" else None)
        assert answer.status_code == 404 and "no session 'nope'" in answer.json()["error"]["message"]


def test_session_limit_and_idle_expiry():
    with running_server(max_sessions=2, idle_timeout=0.5, expiry_interval=0.1) as running:
        ids = [running.client.post("/v1/sessions", json={"prompt": "a"}).json()["id"] for _ in range(2)]
        refused = running.client.post("/v1/sessions", json={"prompt": "a"})
        assert refused.status_code == 429 and "--max-sessions" in refused.json()["error"]["message"]
        running.client.delete(f"/v1/sessions/{ids[0]}")
        assert running.client.post("/v1/sessions", json={"prompt": "a"}).status_code == 201
        deadline = time.monotonic() + 10
        while running.client.get("/healthz").json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running.client.get(f"/v1/sessions/{ids[1]}").status_code == 404
        assert running.client.get("/healthz").json()["slots_used"] == 0
        assert running.client.post("/v1/sessions", json={"prompt": "a"}).status_code == 201


def test_health_answers_while_a_session_decodes():
    with running_server(max_sessions=2) as running:
        sid = running.client.post("/v1/sessions", json={"prompt": "a", "max_tokens": 600,
                                                        "page_size": 16, "max_pages": 8}).json()["id"]
        finished = threading.Event()

        def decode():
            running.client.post(f"/v1/sessions/{sid}/step", json={"n": 600})
            finished.set()

        worker = threading.Thread(target=decode)
        worker.start()
        while not running.client.get("/metrics").text.count('pagevis_steps_total{kind="decode"}'):
            time.sleep(0.01)
        assert running.client.get("/healthz").json()["status"] == "ok"
        assert not finished.is_set(), "/healthz waited for decoding"
        worker.join()


def test_non_loopback_hosts_are_refused_without_allow_remote(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--model", "synthetic"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    from pagevis.cli.serve import check_host

    for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"):
        check_host(host, allow_remote=False)
    check_host("0.0.0.0", allow_remote=True)
    assert "warning" in capsys.readouterr().err


def test_serve_flags_are_checked_before_starting(capsys):
    assert main(["serve", "--port", "70000", "--model", "synthetic"]) == 2
    assert "pagevis serve: error: --port: port = 70000 is not allowed: a port number from 0 to 65535" in \
        capsys.readouterr().err
    assert main(["serve", "--page-size", "0", "--model", "synthetic"]) == 2
    assert "--page-size" in capsys.readouterr().err
    assert main(["serve", "--idle-timeout", "0", "--model", "synthetic"]) == 2


def test_openapi_docs_are_served(server):
    assert server.client.get("/docs").status_code == 200
    paths = server.client.get("/openapi.json").json()["paths"]
    assert {"/v1/attention", "/v1/sessions", "/v1/completions", "/v1/chat/completions", "/metrics"} <= set(paths)



def test_a_failing_step_is_a_json_500_and_ends_the_session(server):
    sid = server.client.post("/v1/sessions", json={"prompt": "a"}).json()["id"]
    engine = server.app.state.store.sessions[sid].session.engine  # the engine it shares
    model = engine.model

    class Broken:
        def __getattr__(self, name):
            return getattr(model, name)

        def forward(self, *args, **kwargs):
            raise RuntimeError("the forward pass broke")

    engine.model = Broken()
    try:
        answer = server.client.post(f"/v1/sessions/{sid}/step", json={"n": 1})
    finally:
        engine.model = model
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "internal error: RuntimeError: the forward pass broke"
    assert server.client.post(f"/v1/sessions/{sid}/step", json={"n": 1}).status_code == 409
    assert server.client.get("/healthz").json()["status"] == "ok"
    server.client.delete(f"/v1/sessions/{sid}")


def test_requests_on_one_session_are_serialised(server):
    sid = server.client.post("/v1/sessions", json={"prompt": "one session, four clients", "chat": False,
                                                   "max_tokens": 60}).json()["id"]
    answers = []

    def step():
        answers.append(server.client.post(f"/v1/sessions/{sid}/step", json={"n": 5}).json())

    threads = [threading.Thread(target=step) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runs = sorted([s["step"] for s in answer["steps"]] for answer in answers)
    assert runs == [list(range(i, i + 5)) for i in range(0, 20, 5)], "each request took 5 consecutive steps"
    assert server.client.get(f"/v1/sessions/{sid}").json()["total_steps"] == 20
    server.client.delete(f"/v1/sessions/{sid}")

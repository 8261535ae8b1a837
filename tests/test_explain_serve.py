"""The explainer against engines that exist: three real `pagevis serve` processes (HTTP on free loopback ports, KV
events and replay on ipc endpoints, request logs; the third with a small pool), real requests. Before each request is sent, the pools
rebuilt from the three event streams are explained; then the request goes to every engine, and each engine's
`cached_tokens` must be the explainer's `hit_tokens` for it, and `best` an engine that answered the most. The
prompts: a system prompt with one word changed on one engine, a prompt shorter than a page, a salted request
(twice), and a prefix evicted from the small pool. Then `attach --explain` (the CLI, live) says the same as the
in-process explainer, and `attach --play RECORDING --explain-log` flags none of the logged requests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagevis.attach.explain import ExplainRequest, explain
from pagevis.attach.explain_run import fleet_engines
from pagevis.attach.recording import Recorder
from pagevis.attach.subscriber import Attacher, parse_source
from pagevis.cli.main import main

PAGE = 4
SYSTEM = "You are a careful assistant. Answer in one short line, and cite the page. "
CHANGED = SYSTEM.replace("careful", "helpful")  # the same length: one word differs
SLOW = pytest.mark.slow  # three server processes: ~12 s here (8 of them starting), in make test-all

MODEL = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Server:
    def __init__(self, tmp, name, pool_pages=None):
        (self.port,) = free_ports(1)
        # ipc endpoints bind (a tcp:// one binds only with a "*" host, which is every interface: vLLM's rule)
        self.events, self.replay = f"ipc://{tmp}/{name}-events", f"ipc://{tmp}/{name}-replay"
        self.log = tmp / f"{name}.jsonl"
        argv = [sys.executable, "-m", "pagevis", "serve", *MODEL, "--port", str(self.port), "--page-size", str(PAGE),
                "--kv-events-endpoint", self.events, "--kv-events-replay", self.replay, "--request-log", str(self.log), "--drain-seconds", "0"]
        if pool_pages:
            argv += ["--pool-pages", str(pool_pages)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def wait(self, deadline):
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"pagevis serve exited: {self.process.stderr.read()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("pagevis serve did not start in time")

    def complete(self, ids, salt=None) -> int:
        body = {"model": "synthetic", "prompt": ids, "max_tokens": 1, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        answer = self.client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def close(self):
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(3)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explain_serve")
    servers = [Server(tmp, "a"), Server(tmp, "b"), Server(tmp, "c", pool_pages=32)]
    try:
        deadline = time.monotonic() + 90
        for server in servers:
            server.wait(deadline)
        recorder = Recorder(tmp / "fleet.kvev", [s.events for s in servers], {"replays": [s.replay for s in servers]})
        attacher = Attacher([parse_source(f"{s.events},{s.replay}") for s in servers], recorder=recorder)
        attacher.start()
        yield servers, attacher, tmp
    finally:
        for server in servers:
            server.close()
    attacher.close()
    recorder.close()


def ids(text):
    return list(text.encode())  # the synthetic model's byte tokenizer: one token a byte, no BOS


def settle(attacher, quiet=0.2):
    """Poll until no event came for `quiet` seconds (each engine publishes a request's events before answering)."""
    last = time.monotonic()
    while time.monotonic() - last < quiet:
        if attacher.poll(0.05):
            last = time.monotonic()


@SLOW
def test_hit_tokens_are_what_each_engine_then_answers(fleet):
    servers, attacher, tmp = fleet
    a, b, c = servers
    assert a.complete(ids(SYSTEM + "Q: one?")) == 0
    assert b.complete(ids(CHANGED + "Q: one?")) == 0
    assert c.complete(ids(SYSTEM + "Q: one?")) == 0
    requests = [(ids(SYSTEM + "Q: two?"), None, "shared system prompt"), (ids("Hi"), None, "shorter than a page"),
                (ids(SYSTEM + "Q: three?"), "tenant-1", "salted"), (ids(SYSTEM + "Q: three?"), "tenant-1", "again")]
    reasons = {}
    for prompt, salt, what in requests:
        settle(attacher)
        out = explain(fleet_engines(attacher.fleet), ExplainRequest(tuple(prompt), salt))
        answered = [server.complete(prompt, salt) for server in servers]
        assert [e["hit_tokens"] for e in out["engines"]] == answered, what
        best = [s.events for s, n in zip(servers, answered) if n == max(answered)]
        assert out["best"]["endpoint"] in best, what
        reasons[what] = [(e["first_miss"] or {}).get("reason") for e in out["engines"]]
        if what == "shared system prompt":
            miss = out["engines"][1]["first_miss"]
            assert (miss["reason"], miss["position"]) == ("token_differs", SYSTEM.index("careful"))
    assert reasons["shorter than a page"] == ["partial_block"] * 3
    assert reasons["salted"] == ["extra_keys"] * 3 and answered == [len(prompt) // PAGE * PAGE] * 3
    for filler in range(6):  # the small pool takes other prompts until the system prompt's pages are reused
        c.complete(ids(f"Filler {filler}: " + "z" * 60))
    settle(attacher)
    prompt = ids(SYSTEM + "Q: four?")
    out = explain(fleet_engines(attacher.fleet), ExplainRequest(tuple(prompt)))
    answered = [server.complete(prompt) for server in servers]
    assert [e["hit_tokens"] for e in out["engines"]] == answered
    assert out["engines"][2]["first_miss"]["reason"] == "removed" and answered[2] < answered[0]

    # the CLI, live, says what the explainer said in process (nothing was sent in between)
    settle(attacher)
    request_file = tmp / "requests.jsonl"
    request_file.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    expected = explain(fleet_engines(attacher.fleet, [0, 0, 0]), ExplainRequest(tuple(prompt)))
    cli = subprocess.run([sys.executable, "-m", "pagevis", "attach", *(f"{s.events},{s.replay}" for s in servers),
                          "--explain", str(request_file), "--idle-exit", "0.3"], capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == json.loads(json.dumps(expected))


@SLOW
def test_the_request_logs_explained_after_the_fact(fleet, capsys):
    servers, attacher, tmp = fleet
    for server in servers:  # two requests of its own, so that every log has some whichever test ran first
        server.complete(ids(SYSTEM + "Q: log?"))
        server.complete(ids(SYSTEM + "Q: log?"), "tenant-2")
    settle(attacher)
    attacher._recorder.flush()
    for server in servers:
        lines = server.log.read_text().splitlines()
        assert len(lines) >= 2
        assert main(["attach", "--play", str(tmp / "fleet.kvev"), "--explain-log", str(server.log)]) == 0
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(out) == len(lines) and {o["served_by"] for o in out} == {server.events}
        assert [o["expected"] for o in out] == [o["reported"] for o in out]
        assert not any(o["flag"] for o in out)


@pytest.mark.parametrize("route", ["/v1/chat/completions"])
def test_a_salt_on_chat_completions_is_in_the_hashes_and_the_events(route):
    """In process (one server thread): the same chat under one salt hits, under none or another it does not; the
    salted first block's BlockStored carries the salt in extra_keys, as vLLM's does, and the explainer says so."""
    from serve_fixtures import running_server

    with running_server(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*") as running:
        publisher = running.app.state.engines.kv_events.publisher

        def ask(salt):
            body = {"model": "synthetic", "messages": [{"role": "system", "content": SYSTEM},
                                                       {"role": "user", "content": "Q: salt?"}],
                    "max_tokens": 1, "temperature": 0, "pagevis": {"page_size": PAGE}}
            if salt:
                body["cache_salt"] = salt
            answer = running.client.post(route, json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert ask("t1") == 0 and ask("t1") > 0 and ask(None) == 0 and ask("t2") == 0
        bad = running.client.post(route, json={"model": "synthetic", "messages": [{"role": "user", "content": "x"}],
                                               "cache_salt": ""})
        assert bad.status_code == 422
        attacher = Attacher([parse_source(f"{publisher.endpoint},{publisher.replay_endpoint}")])
        try:
            attacher.start()
            settle(attacher)
            state = attacher.fleet.engines[0]
        finally:
            attacher.close()
    roots = [extras for extras in state._extra_of if extras and "extra_keys" in extras]
    assert sorted(e["extra_keys"][0] for e in roots) == ["t1", "t2"]  # a first block per salt

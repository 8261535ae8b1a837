"""`pagevis serve --kv-events-endpoint`: the engine's prefix cache published as vLLM's KV events, read back by
`pagevis attach` (replay, then live): the blocks it rebuilds are the pool's cached blocks, hash for hash, with
their parents and tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serve_fixtures import running_server

from pagevis.kvcache.prefix_cache import prefix_hashes


@pytest.mark.slow
def test_attach_rebuilds_the_pools_prefix_cache_from_pagevis_serve(tmp_path):
    with running_server(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*",
                        pool_pages=24) as running:
        prompts = [f"Prompt {i}: pages of keys and values, shared and reclaimed." for i in range(6)]
        for prompt in prompts + prompts[:2]:  # a small pool: later prompts reclaim earlier cached pages
            answer = running.client.post("/v1/completions", json={
                "model": "synthetic", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "pagevis": {"page_size": 4, "max_pages": 20}})
            assert answer.status_code == 200, answer.text
        publisher = running.app.state.engines.kv_events.publisher
        core = next(iter(running.app.state.engines.cores.values()))
        cached = core.call(lambda: dict(core.engine.cache.stores[0].pages.hash_frame)).result(30)
        state_file = tmp_path / "state.json"
        attach = subprocess.run([sys.executable, "-m", "pagevis", "attach",
                                 f"{publisher.endpoint},{publisher.replay_endpoint}", "--headless", "--json",
                                 "--idle-exit", "2", "--save-state", str(state_file)],
                                capture_output=True, text=True, timeout=120)
    assert attach.returncode == 0, attach.stderr
    summary = json.loads(attach.stdout)["endpoints"][0]
    assert summary["events"]["BlockStored"] > 0 and summary["events"]["BlockRemoved"] > 0
    assert summary["gaps_unrecovered"] == summary["decode_errors"] == 0
    blocks = json.loads(state_file.read_text())["endpoints"][0]["blocks"]
    assert {b["hash"] for b in blocks} == set(cached) and summary["resident_blocks"] == {"CPU": len(cached)}
    by_hash = {b["hash"]: b for b in blocks}
    for block in blocks:  # each block's hash is its parent's and its tokens', as the engine hashes pages
        chain, tokens, parent = [], [], block
        while parent is not None:
            chain.append(parent)
            parent = by_hash.get(parent["parent"])
        for b in reversed(chain):
            tokens += b["tokens"]
        if chain[-1]["parent"] is None:
            assert prefix_hashes(tokens, 4)[-1] == block["hash"]


@pytest.mark.parametrize("flag,value,field", [("--kv-events-endpoint", "not-an-endpoint", "kv_events_endpoint"),
                                              ("--kv-events-endpoint", "tcp://*:99999", "kv_events_endpoint"),
                                              ("--kv-events-endpoint", "tcp://127.0.0.1:0", "kv_events_endpoint"),
                                              ("--kv-events-replay", "bogus://x", "kv_events_replay")])
def test_a_bad_kv_events_endpoint_is_one_line_and_exit_2(flag, value, field, capsys):
    from pagevis.cli.main import main

    extra = ["--kv-events-endpoint", "tcp://127.0.0.1:5599"] if flag == "--kv-events-replay" else []
    assert main(["serve", "--model", "synthetic", "--port", "0", *extra, flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and value in err and "Traceback" not in err
    if value.startswith("tcp://"):  # ZMQ would have bound 99999 as port 34463 (mod 65536) without a word
        assert "a port from 1 to 65535" in err

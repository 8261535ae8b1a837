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


def test_each_kind_of_layer_of_a_hybrid_model_is_a_group_of_its_own():
    """With sliding-window layers each kind of layer's prefix cache is a KV cache group of its own (vLLM's
    group_idx): the events of each group, replayed, are that kind's cached pages, hash for hash; the kinds differ (a
    local layer frees pages as its window slides), so layer 0's events alone would not speak for the global layer."""
    from pagevis.attach.events import BlockStored
    from pagevis.engine import Engine, SessionConfig
    from pagevis.engine.batch import BatchConfig
    from pagevis.model.synthetic import SyntheticModel
    from pagevis.serve.kv_events import batch_events, groups

    config = SessionConfig(page_size=4, max_pages=16, policy="none", max_new_tokens=6, chat=False)
    plain = Engine(SyntheticModel(n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, seed=1), config)
    assert groups(plain) == [(None, 0)]  # one kind of layer: no group_idx, as before
    model = SyntheticModel(n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, seed=1, sliding_window=8, global_every=2)
    engine = Engine(model, config, BatchConfig(pool_pages=16))  # a small pool: later prompts reclaim cached pages
    assert groups(engine) == [(0, 0), (1, 1)]  # layer 0 local, layer 1 global
    text = list(b"Local layers keep a window; the global one keeps it all.")
    held: dict = {0: set(), 1: set()}
    for i in range(8):
        engine.submit(text[i: 30 + i] if i % 2 else text[:40])
        for record in engine.run():
            for event in batch_events(engine, record.events):
                change = held[event.group_idx].update if isinstance(event, BlockStored) else \
                    held[event.group_idx].difference_update
                change(event.block_hashes)
    cached = {group: set(engine.cache.cached_pages(layer)) for group, layer in groups(engine)}
    assert held == cached and cached[0] != cached[1]


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

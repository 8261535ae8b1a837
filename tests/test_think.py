"""ThinK (key_channels): the engine's chosen channels and attention equal a brute force in float64 that shares no
code with the engine — its own query window, channel scores, zeroed channels, resident set and dense attention;
the bytes reported; what it refuses; a run from the command line."""

import json

import numpy as np
import pytest

from pagevis.__main__ import main
from pagevis.engine import DecodeSession, SessionConfig
from pagevis.kvcache import CacheConfig, CacheSettings, ConfigError
from pagevis.kvcache.quant import storage_summary
from pagevis.model.synthetic import SyntheticModel

N_LAYERS, N_HEADS, N_KV, HEAD_DIM = 2, 4, 2, 16
WINDOW, N_SINK = 32, 4  # kvpress's window_size; sinks' default


class Recorded:
    """The model, with every attention call of its forward passes kept: layer, q, k, v, positions, output."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, ids, positions, attend, **kwargs):
        def recording(layer, q, k, v, where):
            out = attend(layer, q, k, v, where)
            self.calls.append((layer, q.copy(), k.copy(), v.copy(), where.copy(), out.copy()))
            return out
        return self.model.forward(ids, positions, recording, **kwargs)


def brute_kept(queries, keys, n_pruned):
    """(n_kv, d) bool, kvpress's rule written out: per KV head and channel, the mean over the window's queries of
    its query heads' squares times the mean over the held keys of their squares; the n_pruned lowest go."""
    group = N_HEADS // N_KV
    kept = np.ones((N_KV, HEAD_DIM), dtype=bool)
    for h in range(N_KV):
        scores = []
        for c in range(HEAD_DIM):
            q_power = np.mean([q[head, c] ** 2 for q in queries for head in range(h * group, (h + 1) * group)])
            k_power = np.mean([key[h, c] ** 2 for key in keys])
            scores.append((q_power * k_power, c))
        for _, c in sorted(scores)[:n_pruned]:
            kept[h, c] = False
    return kept


def dense(q, keys, values):
    """float64 attention of one query (n_heads, d) over keys, values (T, n_kv, d)."""
    group = N_HEADS // N_KV
    out = np.zeros((N_HEADS, HEAD_DIM))
    for head in range(N_HEADS):
        scores = keys[:, head // group] @ q[head] / np.sqrt(HEAD_DIM)
        weights = np.exp(scores - scores.max())
        out[head] = (weights / weights.sum()) @ values[:, head // group]
    return out


def brute_force(calls, prompt_len, capacity, ratio):
    """Replays the recorded calls: sinks' resident set, the channels chosen after the call that ends the prompt
    or fills the cache (from the last WINDOW queries and the keys held then), every key zeroed on them from then
    on. Returns each call's expected output and each layer's kept channels."""
    n_pruned = int(HEAD_DIM * ratio)
    tokens = [{} for _ in range(N_LAYERS)]  # position -> (k, v) float64 as the model computed them
    queries = [[] for _ in range(N_LAYERS)]
    kept = [None] * N_LAYERS
    outputs = []
    for layer, q, k, v, positions, _ in calls:
        held = tokens[layer]
        for i, p in enumerate(positions.tolist()):
            if len(held) == capacity:
                del held[min(x for x in held if x >= N_SINK)]
            held[p] = (k[i].astype(np.float64), v[i].astype(np.float64))
        mask = np.ones((N_KV, HEAD_DIM)) if kept[layer] is None else kept[layer]
        rows = []
        for i, p in enumerate(positions.tolist()):
            seen = sorted(x for x in held if x <= p)
            keys = np.stack([held[x][0] for x in seen]) * mask
            rows.append(dense(q[i].astype(np.float64), keys, np.stack([held[x][1] for x in seen])))
        outputs.append(np.stack(rows))
        if kept[layer] is None:
            queries[layer].extend(q.astype(np.float64))
            if positions[-1] + 1 >= prompt_len or len(held) >= capacity:
                kept[layer] = brute_kept(queries[layer][-WINDOW:], [key for key, _ in held.values()], n_pruned)
    return outputs, kept


@pytest.mark.parametrize("prompt, max_pages, ratio, chunk", [
    ("a short prompt", 8, 0.5, None),  # the prompt ends first: its 14 queries score; decoding evicts later
    ("a prompt longer than the cache, streamed through it as compare feeds a text", 12, 0.25, None),  # full first
    ("x" * 30 + "a prompt long enough for a window of 32 queries", 16, 0.75, None),
    ("a prompt prefilled in chunks of 5, its window of 32 spanning seven of them", 32, 0.5, 5),
])
def test_channels_and_attention_match_brute_force(prompt, max_pages, ratio, chunk):
    from pagevis.engine import Engine
    from pagevis.engine.batch import BatchConfig

    model = Recorded(SyntheticModel(n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM, seed=5))
    config = SessionConfig(page_size=4, max_pages=max_pages, policy="sinks", key_channels=ratio, max_new_tokens=24,
                           chat=False)
    engine = Engine(model, config, BatchConfig(max_seqs=1), max_chunk=chunk, hold_finished=True)
    prompt_ids = list(prompt.encode())
    seq_id = engine.submit(prompt_ids)
    while not engine.done:
        engine.step()
    expected, kept = brute_force(model.calls, len(prompt_ids), config.capacity, ratio)
    engine_kept = engine.cache.sequences[seq_id].channels.kept
    for layer in range(N_LAYERS):
        np.testing.assert_array_equal(engine_kept[layer], kept[layer])
        assert (~kept[layer]).sum(axis=1).tolist() == [int(HEAD_DIM * ratio)] * N_KV
    for (_, _, _, _, _, out), reference in zip(model.calls, expected, strict=True):
        np.testing.assert_allclose(out, reference, rtol=2e-4, atol=2e-5)
    stored = engine.cache.stores[0].k  # the keys held: zero on every pruned channel
    assert not np.any(stored * ~kept[0][:, None, None, :])
    assert len({len(positions) for *_, positions, _ in model.calls}) > 1  # prefill chunks and decode steps
    plain = Engine(model.model, SessionConfig(page_size=4, max_pages=max_pages, chat=False), BatchConfig(max_seqs=1))
    plain.submit(prompt_ids)
    plain.step()
    assert all(seq.channels is None for seq in plain.cache.sequences.values())  # off by default


def test_bytes_per_token_are_a_narrow_stores():
    layout = {"n_layers": N_LAYERS, "n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HEAD_DIM}
    plain = CacheConfig(page_size=4, max_pages=4, **layout)
    think = CacheConfig(page_size=4, max_pages=4, key_channels=0.25, **layout)
    half = CacheConfig(page_size=4, max_pages=4, key_channels=0.5, dtype="float16", **layout)
    assert plain.kv_bytes_per_token() == N_LAYERS * N_KV * 2 * HEAD_DIM * 4 == 512
    assert think.kept_key_channels == 12 and think.kv_bytes_per_token() == N_LAYERS * N_KV * (12 + 16) * 4 == 448
    assert half.kv_bytes_per_token() == N_LAYERS * N_KV * (8 + 16) * 2 == 192
    assert think.total_bytes() == plain.total_bytes()  # the arrays here stay full width
    summary = storage_summary(think)
    assert summary["kv_bytes_per_token"] == 448 and summary["kv_bytes_per_token_full_width"] == 512
    assert summary["key_channels_kept"] == 12 and "key_channels" not in storage_summary(plain)
    assert summary["storage_notice"].startswith("keys 12 of 16 channels (ThinK): ") and "full width" in summary[
        "storage_notice"] and "storage_notice" not in storage_summary(plain)


@pytest.mark.parametrize("changes, named", [
    ({"dtype": "int4"}, "dtype = 'int4'"), ({"dtype": "int2"}, "dtype = 'int2'"), ({"dtype": "int8"}, "dtype = 'int8'"),
    ({"disk_pages": 8}, "disk_pages = 8"), ({"select": "quest"}, "select = 'quest'"),
    ({"policy": "kvzip"}, "policy = 'kvzip'"),
])
def test_what_does_not_combine_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError) as error:
        CacheSettings(max_pages=4, key_channels=0.5, **changes).check()
    assert named in str(error.value) and "key_channels 0.5" in str(error.value)
    CacheSettings(max_pages=4, **changes).check()  # each alone is fine


def test_run_json_reports_the_narrow_bytes_and_refuses_int4(capsys):
    synth = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    assert main(["run", *synth, "--prompt", "hello paging", "--page-size", "4", "--max-pages", "3",
                 "--max-tokens", "6", "--key-channels", "0.5", "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["key_channels"] == 0.5 and summary["key_channels_kept"] == 8
    assert summary["kv_bytes_per_token"] == 2 * 2 * (8 + 16) * 4 and summary["kv_bytes_per_token_full_width"] == 512
    assert main(["run", *synth, "--key-channels", "0.5", "--dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "dtype = 'int4' is not allowed" in err and "key_channels 0.5" in err and err.count("\n") == 1


def test_compare_has_a_think_row_with_its_bytes(capsys):
    assert main(["compare", "--model", "synthetic", "--tokens", "60", "--budgets", "32", "--no-optimal", "--json",
                 "--no-files", "--quiet", "--policies", "sinks,sinks:key_channels=0.5"]) == 0
    plain, think = json.loads(capsys.readouterr().out)["rows"]
    assert (plain["policy"], think["policy"]) == ("sinks", "sinks+think(0.5)") and think["key_channels"] == 0.5
    assert think["kv_bytes_per_token"] == 0.75 * plain["kv_bytes_per_token"]  # K and V: half the key channels go
    assert think["ppl"] != plain["ppl"] and think["evictions"] == plain["evictions"]
    assert main(["compare", "--model", "synthetic", "--tokens", "60", "--budgets", "32", "--no-files", "--quiet",
                 "--policies", "quest:key_channels=0.5"]) == 2
    assert "disk_pages = " in capsys.readouterr().err


def test_pruning_copies_a_shared_page_and_leaves_the_other_sequence_whole():
    """A page another sequence shares (a prefix hit) is copied before its keys are zeroed; the pruned pages
    leave the prefix cache."""
    from pagevis.kvcache import KVCacheManager

    config = CacheConfig(page_size=4, max_pages=16, policy="none", key_channels=0.5, n_layers=1, n_heads=N_HEADS,
                         n_kv_heads=N_KV, head_dim=HEAD_DIM)
    cache = KVCacheManager(config)
    cache.add_sequence(0)
    rng = np.random.default_rng(0)
    k, v, q = (rng.standard_normal((9, n, HEAD_DIM)).astype(np.float32) for n in (N_KV, N_KV, N_HEADS))
    tokens, positions = list(range(9)), np.arange(9)
    cache.extend(0, tokens)
    cache.append(0, 0, k, v, positions)
    cache.attend(0, 0, q, positions)
    cache.commit(0)  # the prompt goes on: its two full pages are registered
    cache.add_sequence(1)
    assert cache.match_prefix(1, tokens) == 8
    shared = list(cache.block_table(1))
    cache.commit(0, prompt_done=True)
    kept = cache.sequences[0].channels.kept[0]
    assert cache.block_table(1) == shared and not set(shared) & set(cache.block_table(0))
    store = cache.stores[0]
    np.testing.assert_array_equal(store.k[:, shared].reshape(N_KV, 8, HEAD_DIM), k[:8].transpose(1, 0, 2))
    mine = store.k[:, cache.block_table(0)].reshape(N_KV, 12, HEAD_DIM)[:, :9]
    np.testing.assert_array_equal(mine, np.where(kept[:, None], k.transpose(1, 0, 2), 0))
    assert [store.pages.lookup(h) for h in cache.sequences[0].hashes] == shared  # the plain pages stay cached


def test_a_served_completion_prunes_in_a_pool_of_its_own():
    """The server keys its pools by key_channels too: a completion asking for ThinK equals a direct session with
    it (a pool built without it would ignore the request's value)."""
    from serve_fixtures import SYNTH, running_server

    cache = {"page_size": 4, "max_pages": 4, "policy": "tova"}
    with running_server() as server:
        def complete(**extra):
            body = {"model": "synthetic", "prompt": "The cache holds", "max_tokens": 16, "temperature": 0,
                    "pagevis": {**cache, **extra}}
            answer = server.client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        plain, pruned = complete(), complete(key_channels=0.5)
        assert len(server.app.state.engines.cores) == 2
    session = DecodeSession(SYNTH.load(), "The cache holds", SessionConfig(**cache, key_channels=0.5,
                                                                          max_new_tokens=16, chat=False))
    list(session.run())
    assert pruned == session.text() != plain


@pytest.mark.parametrize("policy, params", [("sinks", {"rerotate": 1}), ("tova", {"rerotate": 1}),
                                            ("merge", {}), ("adakv", {})])
def test_keys_stay_pruned_under_policies_that_rewrite_or_mask(policy, params):
    """Re-rotation turns a RoPE pair with one pruned channel: the channel is zeroed again. Merging (values only)
    and per-head masks leave the pruned keys as they are."""
    model = SyntheticModel(n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM, seed=5)
    config = SessionConfig(page_size=4, max_pages=6, policy=policy, policy_params=params, key_channels=0.5,
                           max_new_tokens=24, chat=False)
    session = DecodeSession(model, "a prompt of a few tokens", config)
    for _ in session.run():
        pass
    seq = session.cache.sequences[session.seq_id]
    assert session.records[-1].evictions_total > 0
    for layer, store in enumerate(session.cache.stores):
        held = np.flatnonzero(store.positions >= 0)
        keys = store.k[:, held // 4, held % 4]  # (n_kv, held, d)
        assert not np.any(keys * ~seq.channels.kept[layer][:, None, :])
        assert np.all(np.any(keys != 0, axis=1) == seq.channels.kept[layer])  # the kept ones are not all zero


def test_the_oracle_keeps_whole_keys(capsys):
    synth = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    runs = {}
    for ratio in ("0", "0.5"):
        assert main(["run", *synth, "--prompt", "hello paging", "--page-size", "4", "--max-pages", "8",
                     "--max-tokens", "8", "--key-channels", ratio, "--oracle", "--no-chat", "--json", "--quiet"]) == 0
        runs[ratio] = json.loads(capsys.readouterr().out)
    # no eviction: only the pruned channels differ (the oracle's prefill takes every row's weights through NumPy, the
    # engine's the chunk kernel: float32 rounding apart, ~1e-13 here)
    assert runs["0"]["mean_kl"] < 1e-9 and runs["0.5"]["mean_kl"] > 1e-6


def test_the_app_says_how_narrow_the_keys_are_in_the_page_grid_and_status_bar(qtbot, tmp_path):
    pytest.importorskip("pytestqt")
    from dataclasses import replace

    from gui_helpers import CONFIG, make_window, step

    window = make_window(qtbot, tmp_path, config=replace(CONFIG, key_channels=0.5))
    step(qtbot, window)
    plot = window.page_grid.plot  # its title says it where it fits; the tooltip holds the whole line otherwise
    assert "keys 8 of 16 channels (ThinK)" in plot.titleLabel.text + plot.toolTip()  # head_dim 16, half pruned
    assert "keys 8 of 16 channels (ThinK)" in window.status_memory.text()
    plain = make_window(qtbot, tmp_path / "plain")
    step(qtbot, plain)
    assert "ThinK" not in plain.page_grid.plot.titleLabel.text + plain.page_grid.plot.toolTip()

"""Hybrid caches: sliding-window (local) layers beside global ones, against independent references — float64
attention with the window mask, a brute-force simulation of which pages leave when, the dense model."""

import json

import numpy as np
import pytest
from engine_reference import WindowedDenseAttend, page_kv, windowed_attention_f64
from hypothesis import given, settings
from hypothesis import strategies as st

from pagevis.__main__ import main
from pagevis.engine import DecodeSession, Engine, SamplingConfig, SessionConfig
from pagevis.engine.batch import BatchConfig
from pagevis.kvcache import CacheConfig, ConfigError, EventKind, KVCacheManager
from pagevis.kvcache.prefix_cache import prefix_hashes
from pagevis.kvcache.quant import storage_summary
from pagevis.kvcache.layer_spec import first_kept_page, layer_specs, pages_held
from pagevis.model.synthetic import SyntheticModel, window_pattern

W, PS = 10, 4
MODEL = SyntheticModel(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, seed=3, sliding_window=W, global_every=3)
PROMPT = list(b"Local layers keep a window; the global one keeps it all.")


def cache_config(windows=(W, None), **settings):
    base = dict(page_size=PS, max_pages=40, n_layers=len(windows), n_heads=4, n_kv_heads=2, head_dim=8,
                policy="none", sliding_windows=windows)
    return CacheConfig(**{**base, **settings})


def session_config(**settings):
    base = dict(page_size=PS, max_pages=32, policy="none", max_new_tokens=20, chat=False,
                sampling=SamplingConfig(mode="greedy"))
    return SessionConfig(**{**base, **settings})


def test_the_pattern_marks_every_kth_layer_global_as_gemma3():
    windows = window_pattern(18, 512, 6)
    assert [layer for layer, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert [spec.label for spec in layer_specs(windows, 18)[4:6]] == ["local W=512", "global"]
    assert window_pattern(4, 0, 6) is None and window_pattern(3, 8, 0) == (8, 8, 8)
    assert MODEL.config.sliding_windows == (W, W, None)


@pytest.mark.parametrize("tier", [{}, {"dtype": "float16"}, {"dtype": "int8"}, {"disk_pages": 40, "max_pages": 3},
                                  {"select": "quest", "select_pages": 8}])
def test_windowed_attention_over_pages_equals_dense_float64_with_the_window_mask(tier, tmp_path):
    """Decode one token at a time, then a prefill chunk: every query's output equals float64 attention over
    exactly the positions its window sees (the keys as stored: float16 and int8 read back through the cache)."""
    config = cache_config(swap_dir=str(tmp_path), **tier)
    cache = KVCacheManager.single(config)
    rng = np.random.default_rng(0)
    shape = (config.n_kv_heads, config.head_dim)
    tokens = [dict() for _ in range(config.n_layers)]

    def feed(first, n):
        k = rng.standard_normal((n, *shape)).astype(np.float32)
        v = rng.standard_normal((n, *shape)).astype(np.float32)
        q = (2 * rng.standard_normal((n, config.n_heads, config.head_dim))).astype(np.float32)
        positions = np.arange(first, first + n)
        for layer in range(config.n_layers):
            cache.append(0, layer, k, v, positions)
            result = cache.attend(0, layer, q, positions)
            store = cache.stores[layer]
            for i, p in enumerate(positions.tolist()):  # the reference reads K/V as the pages hold them
                page, slot = divmod(int(np.flatnonzero(store.positions == p)[0]), PS)
                keys, values = page_kv(store, page)
                tokens[layer][p] = (keys[:, slot], values[:, slot])
            for i, p in enumerate(positions.tolist()):
                expected, _ = windowed_attention_f64(q[i], p, tokens[layer], config.sliding_windows[layer])
                tolerance = 2e-5 if config.select == "all" or p < 8 * PS else None
                if tolerance is not None:  # quest reads only 8 pages: exact while the window fits in them
                    np.testing.assert_allclose(result.output[i], expected, atol=tolerance, rtol=tolerance)
        cache.commit(0)

    for position in range(45):
        feed(position, 1)
    feed(45, 13)  # a chunk longer than the window: its early queries see keys the later ones do not
    feed(58, 1)
    assert cache.resident(0, 0) <= W + PS and cache.resident(0, 1) == 59
    cache.close()


def test_every_batch_record_gives_the_pools_bytes_by_layer_type_as_its_block_tables_count_them():
    cfg = session_config(max_new_tokens=25, sampling=SamplingConfig(mode="sample", seed=5))
    engine = Engine(MODEL, cfg, BatchConfig(max_seqs=3))
    engine.submit_parallel(PROMPT, 3)
    page_bytes, seen_slides = engine.cache_config.page_bytes(), False
    for record in engine.run():
        running = list(record.n_cached)
        # brute force: each layer's distinct pages over the running sequences' block tables (shared ones once)
        pages = [len({p for s in running for p in engine.cache.block_table(s, layer)}) for layer in range(3)]
        local, global_ = pages[0] + pages[1], pages[2]
        assert record.hybrid == (local * page_bytes, global_ * page_bytes, 3 * global_ * page_bytes, 2, 1)
        seen_slides |= pages[0] < global_
    assert seen_slides  # the local layers held fewer pages than the global one at some step
    plain = Engine(SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3), cfg, BatchConfig())
    plain.submit(PROMPT)
    assert all(record.hybrid is None for record in plain.run())  # no window, no line


def test_a_batch_records_pages_are_its_fullest_layers_over_every_kind_of_layer_not_layer_0s():
    """Layer 0 is a local layer here (as on Gemma 3): past its window it holds fewer pages than the global layer. A
    record's pages in use, without sharing and tokens stored (`pagevis run --n`'s pages line, the Sequences window)
    are those of the layer holding the most pages; brute force: the distinct pages of the running sequences' block
    tables, their lengths, the distinct slots holding a token."""
    cfg = session_config(max_new_tokens=25, sampling=SamplingConfig(mode="sample", seed=5))
    engine = Engine(MODEL, cfg, BatchConfig(max_seqs=3))
    engine.submit_parallel(PROMPT, 3)
    cache, seen_slides = engine.cache, False
    for record in engine.run():
        running = list(record.n_cached)
        used = [len({p for s in running for p in cache.block_table(s, layer)}) for layer in range(3)]
        fullest = used.index(max(used))
        stored = {int(slot) for s in running for slot in cache.flat_slots(s, fullest)
                  if cache.slot_positions(fullest)[slot] >= 0}
        assert (record.pages_used, record.pages_unshared, record.tokens_stored) == (
            used[fullest], sum(len(cache.block_table(s, fullest)) for s in running), len(stored))
        seen_slides |= used[0] < used[fullest]
    assert seen_slides


def simulate_slides(n_steps_tokens, window, page_size):
    """Brute force: after each step (tokens written so far), which logical pages a local layer has let go of —
    those whose newest position is below the newest query's window. Returns per step the newest position of
    each page that left at that step."""
    gone, per_step, written = set(), [], 0
    for n in n_steps_tokens:
        written += n
        oldest_seen = written - 1 - window + 1
        left = {page for page in range(written // page_size + 1)
                if (page + 1) * page_size - 1 < oldest_seen and page not in gone}
        gone |= left
        per_step.append(sorted((page + 1) * page_size - 1 for page in left))
    return per_step


def test_pages_leave_a_local_layer_when_brute_force_says_and_it_never_holds_more_than_window_plus_a_page():
    cfg = session_config(max_new_tokens=60)
    engine = Engine(MODEL, cfg, max_chunk=7, hold_finished=True)
    engine.submit(PROMPT)
    fed, slid, held = [], [], []
    for record in engine.run():
        fed.append(len(engine.last_plan[0][0]) if 0 in engine.last_plan else 0)
        slid.append(sorted(e.position for e in record.events if e.kind is EventKind.SLIDE and e.layer == 0))
        if 0 in engine.cache.sequences:
            held.append([engine.cache.resident(0, layer) for layer in range(3)])
    assert slid == simulate_slides(fed, W, PS)
    assert sum(map(len, slid)) > 15  # the run is long enough for many pages to leave
    assert max(h[0] for h in held) <= W + PS and max(h[1] for h in held) <= W + PS
    assert held[-1][2] == len(PROMPT) + 60 - 1  # the global layer keeps every token (the last is not fed)


def test_a_hybrid_model_decodes_what_the_dense_windowed_model_predicts():
    """Greedy decoding over the paged hybrid cache picks, at every step, the argmax of a float64 dense forward
    with each layer's window mask over the same tokens (one forward, shares no code with the cache)."""
    session = DecodeSession(MODEL, "", session_config(max_new_tokens=30), prompt_ids=PROMPT)
    list(session.run())
    tokens = PROMPT + session.generated
    dense = WindowedDenseAttend(MODEL.config.sliding_windows)
    logits = MODEL.forward(np.array(tokens[:-1]), np.arange(len(tokens) - 1), dense,
                           logit_rows=np.arange(len(PROMPT) - 1, len(tokens) - 1))
    predicted = np.argmax(logits, axis=-1).tolist()
    assert predicted == session.generated


def test_many_sequences_with_windows_decode_what_each_decodes_alone():
    cfg = session_config(max_new_tokens=25, sampling=SamplingConfig(mode="sample", seed=5))
    engine = Engine(MODEL, cfg, BatchConfig(max_seqs=3))
    ids = engine.submit_parallel(PROMPT, 3)
    records = list(engine.run())
    for i, seq_id in enumerate(ids):
        alone = DecodeSession(MODEL, "", session_config(max_new_tokens=25, sampling=SamplingConfig(
            mode="sample", seed=5 + i)), prompt_ids=PROMPT)
        list(alone.run())
        assert engine.requests[seq_id].generated == alone.generated
    kinds = {e.kind for r in records for e in r.events}
    assert {EventKind.SHARE, EventKind.SLIDE} <= kinds


def test_a_prefix_hit_takes_only_the_last_window_of_a_local_layer():
    cache = KVCacheManager(cache_config())
    rng = np.random.default_rng(1)
    ids = list(range(100, 130))  # 30 tokens: 7 full pages
    cache.add_sequence(0)
    cache.extend(0, ids)
    for layer in range(2):
        kv = rng.standard_normal((30, 2, 8)).astype(np.float32)
        cache.append(0, layer, kv, kv, np.arange(30))
    cache.commit(0)  # registers the full pages, then the local layer lets go of those before position 20
    assert [cache.stores[0].positions[p * PS] for p in cache.block_table(0, 0)] == [20, 24, 28]
    cache.free(0)
    local = cache.stores[0].pages
    logical = [local.lookup(h) for h in prefix_hashes(ids, PS)]  # the local layer's page of each logical page
    assert None not in logical  # a page that slid out stays cached, as a freed one does

    def hit(seq_id):
        cache.add_sequence(seq_id)
        n = cache.match_prefix(seq_id, ids)
        table = list(cache.block_table(seq_id, 0))
        assert len(cache.block_table(seq_id, 1)) == n // PS  # the global layer takes every page
        cache.free(seq_id)
        return n, table

    # the next query (position 28) sees positions 19..28: logical pages 4, 5, 6
    assert hit(1) == (28, logical[4:7])
    local.forget(logical[0])  # right to left: old pages may be gone, the hit stands on its last window
    assert hit(2) == (28, logical[4:7])
    local.forget(logical[5])  # in the last window: the longest hit whose window is cached ends at page 5
    assert hit(3) == (20, logical[2:5])


def test_a_restart_hits_the_prefix_cache_on_both_kinds_of_layer_and_decodes_the_same():
    session = DecodeSession(MODEL, "", session_config(max_new_tokens=12), prompt_ids=PROMPT)
    list(session.run())
    first = list(session.generated)
    session.restart()
    records = list(session.run())
    assert session.generated == first
    events = [e for r in records for e in r.events]
    hit = next(e.detail for e in events if e.kind is EventKind.PREFIX_HIT)
    assert hit >= 3 * W
    shares = [sum(e.kind is EventKind.SHARE and e.layer == layer for e in events) for layer in range(3)]
    assert shares[2] == hit // PS and shares[0] == shares[1] == hit // PS - first_kept_page(hit, W, PS)


@pytest.mark.parametrize("max_pages", [2, 10])
def test_a_policy_budget_smaller_than_the_window_applies_on_local_layers(max_pages):
    """Budget 8 < W: local layers evict at 8 too. Budget 40 >= W: the window alone bounds them (no eviction
    there), while the global layer evicts at 40."""
    cfg = session_config(policy="oldest", max_pages=max_pages, max_new_tokens=30)
    engine = Engine(MODEL, cfg, hold_finished=True)
    engine.submit(PROMPT)
    evicted, most = [0, 0, 0], [0, 0, 0]
    for record in engine.run():
        for e in record.events:
            evicted[e.layer] += e.kind is EventKind.EVICT
        most = [max(m, engine.cache.resident(0, layer)) for layer, m in enumerate(most)]
    assert evicted[2] > 0 and most[2] == cfg.capacity
    if cfg.capacity < W:
        assert evicted[0] > 0 and most[0] <= cfg.capacity
    else:
        assert evicted[0] == evicted[1] == 0 and most[0] <= W + PS


def test_windows_with_int4_or_a_wrong_length_are_refused_naming_both_settings():
    with pytest.raises(ConfigError, match="dtype.*sliding_windows"):
        cache_config(dtype="int4")
    with pytest.raises(ConfigError, match="sliding_windows.*one entry per layer"):
        cache_config(windows=(W,), n_layers=2)
    with pytest.raises(ConfigError, match="sliding_windows"):
        cache_config(windows=(0, None))
    assert cache_config(windows=(None, None)).sliding_windows is None


def test_a_fork_behind_the_window_is_refused_and_one_at_the_end_continues():
    engine = Engine(MODEL, session_config(max_new_tokens=40))
    seq = engine.submit(PROMPT)
    for _ in range(20):
        engine.step()
    with pytest.raises(ConfigError, match="local layer 0"):
        engine.fork(seq, 10)
    child = engine.fork(seq)
    list(engine.run())
    assert len(engine.requests[child].generated) > 0


@pytest.mark.parametrize("at", [None, 3])
def test_a_fork_of_a_prompt_shorter_than_the_window_is_allowed(at):
    # nothing has slid out of the window yet (`run --n 2` on Gemma 3 with any short prompt was refused: "no longer
    # holds position -1")
    engine = Engine(MODEL, session_config(max_new_tokens=4))
    seq = engine.submit(PROMPT[:W - 4])
    engine.step()
    child = engine.fork(seq, at)
    list(engine.run())
    assert len(engine.requests[child].generated) > 0


def test_pages_held_counts_a_window_and_a_page_at_most():
    local, full = layer_specs((512, None), 2)
    assert pages_held(full, 4096, 16) == 256
    assert pages_held(local, 4096, 16) == 32 and pages_held(local, 100, 16) == 7
    assert all(pages_held(local, n, 16) * 16 <= 512 + 16 + 15 for n in range(1, 3000, 7))


def test_run_reports_bytes_by_layer_type_and_without_windows():
    session = DecodeSession(MODEL, "", session_config(max_new_tokens=30), prompt_ids=PROMPT)
    list(session.run())
    summary = storage_summary(session.cache_config, session.cache.stores)
    page_bytes = 2 * PS * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    n = len(PROMPT) + 30 - 1  # the prompt in one step, then one token a step (the last is not fed)
    # brute force: a local layer's pages between steps after t tokens, at its most over the run's steps
    written = [len(PROMPT)] + list(range(len(PROMPT) + 1, n + 1))
    local_pages = max(sum(1 for page in range(-(-t // PS)) if (page + 1) * PS - 1 >= t - W) for t in written)
    assert local_pages == -(-(W + PS - 1) // PS)
    assert summary["kv_bytes_local"] == 2 * local_pages * page_bytes
    assert summary["kv_bytes_global"] == -(-n // PS) * page_bytes
    assert summary["kv_bytes_without_windows"] == 3 * -(-n // PS) * page_bytes
    assert summary["local_layers"] == 2 and summary["global_layers"] == 1


def test_compare_on_a_hybrid_model_scores_against_the_windowed_dense_model_and_reports_its_bytes(capsys, tmp_path):
    text = "Sliding windows keep the newest tokens; global layers keep them all, so memory grows by a sixth."
    ids = list(text.encode())[:80]
    dense = WindowedDenseAttend(MODEL.config.sliding_windows)
    logits = MODEL.forward(np.array(ids), np.arange(len(ids)), dense, all_logits=True)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected = float(np.exp(-np.mean([logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)])))
    path = tmp_path / "text.txt"
    path.write_text(text)
    argv = ["compare", str(path), "--model", "synthetic", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--model-seed", "3", "--sliding-window", str(W), "--global-every", "3", "--policies", "none",
            "--budgets", "96", "--page-size", str(PS), "--tokens", "80", "--no-files", "--quiet"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["full_cache_ppl"] == pytest.approx(expected, rel=1e-4)
    assert result["rows"][0]["ppl"] == pytest.approx(expected, rel=1e-4)
    page_bytes = 2 * PS * 2 * 16 * 4
    assert result["hybrid"]["kv_bytes_global"] == 20 * page_bytes  # 80 tokens: 20 pages
    assert result["hybrid"]["kv_bytes_local"] == 2 * 3 * page_bytes  # positions 70..79
    assert result["hybrid"]["kv_bytes_without_windows"] == 3 * 20 * page_bytes
    assert main(argv) == 0
    assert "full-cache row: hybrid K/V" in capsys.readouterr().out


def test_the_bench_measures_a_gemma3_layout_that_holds_what_the_model_says():
    from pagevis.bench.hybrid import format_rows, hybrid_rows

    small = dict(n_layers=6, n_heads=2, n_kv_heads=1, head_dim=8, window=16, global_every=3)  # Gemma's shape, small
    rows = hybrid_rows([10, 100], page_size=4, layout=small, repeats=2)
    short, long = rows
    assert short["kv_bytes_hybrid"] == short["kv_bytes_without_windows"]  # shorter than the window: no saving
    page_bytes = 2 * 4 * 8 * 2  # K and V of 4 tokens, 1 KV head, d 8, float16
    assert long["kv_bytes_global"] == 2 * 25 * page_bytes and long["kv_bytes_without_windows"] == 6 * 25 * page_bytes
    # measured between steps of 512-token chunks: a 100-token prompt is one step, so the local layer ends at
    # positions 84..99 (4 pages)
    assert long["kv_bytes_local"] == 4 * 4 * page_bytes == long["modelled_bytes_hybrid"] - long["kv_bytes_global"]
    assert long["local_us"] > 0 and long["global_us"] > 0
    assert "4 local layers W=16, 2 global" in format_rows(rows)[0]


@pytest.mark.parametrize("settings", [dict(disk_pages=32, max_pages=6), dict(select="quest", select_pages=3),
                                      dict(dtype="int8"), dict(policy="h2o", max_pages=2),
                                      dict(policy="sinks", max_pages=3,
                                                                              policy_params={"n_sink": 4})])
def test_windows_with_a_disk_tier_quest_int8_or_an_evicting_policy_decode_alone_what_they_decode_batched(
        settings, tmp_path):
    """Two samples of one prompt over one pool (pages shared, then copied, slid and evicted per sequence) decode
    what each decodes alone with the same settings; local layers stay within their bound."""
    cfg = session_config(max_new_tokens=10, swap_dir=str(tmp_path), sampling=SamplingConfig(mode="sample", seed=5),
                         **settings)
    engine = Engine(MODEL, cfg, BatchConfig(max_seqs=2))
    ids = engine.submit_parallel(PROMPT, 2)
    for _ in engine.run():
        for seq_id in engine.cache.sequences:
            assert engine.cache.resident(seq_id, 0) <= W + PS
    for i, seq_id in enumerate(ids):
        alone = DecodeSession(MODEL, "", session_config(**{**cfg.__dict__, "sampling": SamplingConfig(
            mode="sample", seed=5 + i)}), prompt_ids=PROMPT)
        list(alone.run())
        assert engine.requests[seq_id].generated == alone.generated
    engine.close()


def test_a_per_head_policy_keeps_its_budget_on_local_layers_below_the_window():
    """adakv with a budget of 3 tokens per KV head (below W): every layer, local ones too, holds at most
    n_kv_heads x 3 (KV head, token) entries; the local layers' pages still slide."""
    cfg = session_config(policy="adakv", max_pages=4, policy_params={"budget": 3}, max_new_tokens=20)
    engine = Engine(MODEL, cfg, hold_finished=True)
    engine.submit(PROMPT)
    kinds = set()
    for record in engine.run():
        kinds |= {(e.kind, e.layer) for e in record.events}
        assert all(engine.cache.head_entries(0, layer) <= 2 * 3 for layer in range(3))
    assert {(EventKind.MASK, 0), (EventKind.MASK, 2), (EventKind.SLIDE, 0)} <= kinds


def test_a_cache_of_local_layers_only_streams_past_its_pool_under_policy_none(capsys):
    """Every layer local, 3 pages (12 tokens) for a 56-token prompt and 40 more: the prompt is fed in chunks the
    pool holds, the windows slide, and greedy decoding equals the dense windowed model's argmax."""
    local = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3, sliding_window=6)
    session = DecodeSession(local, "", session_config(max_pages=3, max_new_tokens=40), prompt_ids=PROMPT)
    records = list(session.run())
    assert session.stop_reason == "max_new_tokens" and len(session.generated) == 40
    assert sum(r.kind == "prefill" for r in records) > 1  # chunks: the pool holds 12 tokens at a time
    tokens = PROMPT + session.generated
    logits = local.forward(np.array(tokens[:-1]), np.arange(len(tokens) - 1), WindowedDenseAttend((6, 6)),
                           logit_rows=np.arange(len(PROMPT) - 1, len(tokens) - 1))
    assert np.argmax(logits, axis=-1).tolist() == session.generated
    args = ["run", "--model", "synthetic", "--layers", "2", "--sliding-window", "6", "--page-size", "4",
            "--max-pages", "3", "--max-tokens", "5", "--policy", "none", "--quiet", "--no-chat"]
    assert main(args) == 0  # the prompt-fits check knows a cache of local layers never fills
    assert main([*args, "--global-every", "2"]) == 2  # with a global layer it does
    assert "--policy none: the prompt is" in capsys.readouterr().err


def test_run_json_reports_the_tokens_each_kind_of_layer_holds(capsys):
    """`pagevis run --json` on a hybrid model: the global layer holds every token fed, the local one the pages its
    window still sees (brute force from the window), where peak_resident_tokens is layer 0's alone."""
    window, ps = 6, 4
    args = ["run", "--model", "synthetic", "--layers", "2", "--sliding-window", str(window), "--global-every", "2",
            "--page-size", str(ps), "--max-pages", "32", "--max-tokens", "5", "--policy", "none", "--quiet",
            "--no-chat", "--prompt", "a prompt longer than the window", "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    n = summary["prompt_tokens"] + summary["generated_tokens"] - 1  # the last token sampled is not fed
    local = n - (n - window) // ps * ps  # from the page of the oldest position the newest query sees
    assert summary["resident_tokens_by_layers"] == {f"local W={window}": local, "global": n}
    assert local < n


@settings(max_examples=12, deadline=None)
@given(window=st.integers(1, 20), page_size=st.integers(1, 8), chunk=st.integers(1, 30), n_prompt=st.integers(1, 50),
       n_new=st.integers(1, 12), global_every=st.integers(0, 3))
def test_random_windows_pages_and_chunks_slide_as_brute_force_says_and_decode_as_the_dense_model(
        window, page_size, chunk, n_prompt, n_new, global_every):
    model = SyntheticModel(n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, seed=window, sliding_window=window,
                           global_every=global_every)
    windows = model.config.sliding_windows
    cfg = session_config(page_size=page_size, max_pages=-(-(n_prompt + n_new) // page_size), max_new_tokens=n_new)
    engine = Engine(model, cfg, max_chunk=chunk, hold_finished=True)
    engine.submit(PROMPT[:n_prompt])
    fed, slid = [], [[] for _ in windows]
    for record in engine.run():
        fed.append(len(engine.last_plan[0][0]) if 0 in engine.last_plan else 0)
        for layer, w in enumerate(windows):
            slid[layer].append(sorted(e.position for e in record.events if e.kind is EventKind.SLIDE and e.layer == layer))
            if w:
                assert engine.cache.resident(0, layer) <= w + page_size - 1  # between steps
    for layer, w in enumerate(windows):
        assert slid[layer] == (simulate_slides(fed, w, page_size) if w else [[] for _ in fed])
    generated = engine.requests[0].generated
    tokens = PROMPT[:n_prompt] + generated
    logits = model.forward(np.array(tokens[:-1]), np.arange(len(tokens) - 1), WindowedDenseAttend(windows),
                           logit_rows=np.arange(n_prompt - 1, len(tokens) - 1))
    assert np.argmax(logits, axis=-1).tolist() == generated


@settings(max_examples=10, deadline=None)
@given(window=st.integers(1, 16), page_size=st.integers(1, 6), n_prompt=st.integers(2, 40), extra=st.integers(0, 10),
       spare=st.integers(0, 6), global_every=st.integers(0, 2))
def test_random_prefix_hits_on_hybrid_caches_decode_as_the_dense_model(window, page_size, n_prompt, extra, spare,
                                                                       global_every):
    """One request, then another whose prompt starts with the first's text: the second takes what the prefix cache
    still has (a small pool reclaims some of it) and still decodes what the dense windowed model predicts."""
    model = SyntheticModel(n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, seed=1, sliding_window=window,
                           global_every=global_every)
    n_new = 6
    need = -(-(n_prompt + extra + n_new) // page_size)
    cfg = session_config(page_size=page_size, max_pages=need, max_new_tokens=n_new)
    engine = Engine(model, cfg, BatchConfig(pool_pages=need + spare))
    first = engine.submit(PROMPT[:n_prompt])
    list(engine.run())
    prompt = PROMPT[:n_prompt] + engine.requests[first].generated[:extra] + PROMPT[:extra]
    second = engine.submit(prompt)
    records = list(engine.run())
    hits = [e.detail for r in records for e in r.events if e.kind is EventKind.PREFIX_HIT]
    assert all(hit % page_size == 0 and hit < len(prompt) for hit in hits)
    generated = engine.requests[second].generated
    tokens = list(prompt) + generated
    logits = model.forward(np.array(tokens[:-1]), np.arange(len(tokens) - 1),
                           WindowedDenseAttend(model.config.sliding_windows),
                           logit_rows=np.arange(len(prompt) - 1, len(tokens) - 1))
    assert np.argmax(logits, axis=-1).tolist() == generated


def test_a_server_engines_pool_gauges_report_the_local_and_global_layers_apart():
    """Each kind of layer's pools have their own usage gauge (counted from the block tables, brute force); the
    overall ratio is over every layer's pool, not layer 0's (a local one here)."""
    from prometheus_client import generate_latest
    from test_serve_load import scrape, value

    from pagevis.observe import Metrics

    metrics = Metrics()
    observer = metrics.observe_engine("e")
    cfg = session_config(max_new_tokens=25, sampling=SamplingConfig(mode="sample", seed=5))
    engine = Engine(MODEL, cfg, BatchConfig(max_seqs=3))
    engine.submit_parallel(PROMPT, 3)
    pool, seen_apart = engine.cache.pool_pages, False
    for _ in engine.run():
        observer.queues(engine)
        pages = [len({p for s in engine.cache.seq_ids() for p in engine.cache.block_table(s, layer)})
                 for layer in range(3)]
        samples = scrape(generate_latest(metrics.registry).decode())
        local = value(samples, "pagevis_kv_cache_layer_usage_ratio", engine="e", layers=f"local W={W}")
        global_ = value(samples, "pagevis_kv_cache_layer_usage_ratio", engine="e", layers="global")
        assert local == pytest.approx((pages[0] + pages[1]) / (2 * pool)) and global_ == pytest.approx(pages[2] / pool)
        assert value(samples, "pagevis_kv_cache_usage_ratio") == pytest.approx(sum(pages) / (3 * pool))
        seen_apart |= local < global_
    assert seen_apart
    metrics.forget_engine(observer)
    assert not any(name == "pagevis_kv_cache_layer_usage_ratio" for name, _ in scrape(
        generate_latest(metrics.registry).decode()))


def test_a_sessions_usage_gauges_count_every_layer_and_each_kind_apart():
    """`pagevis run`'s and the app's gauges (a session's observer): the overall ratio is the resident tokens of every
    layer over every layer's capacity, not layer 0's (a local one here); the layer gauge shows the local and global
    layers apart, as engine "sessions". Counted from each record's slot maps, brute force."""
    from prometheus_client import generate_latest
    from test_serve_load import scrape, value

    from pagevis.observe import Metrics

    metrics = Metrics()
    session = DecodeSession(MODEL, "", session_config(max_new_tokens=12), prompt_ids=PROMPT)
    observer = metrics.observe(session)
    capacity, seen_apart = session.cache_config.capacity, False
    for record in session.run():
        held = [int((record.slot_maps[layer] >= 0).sum()) for layer in range(3)]
        samples = scrape(generate_latest(metrics.registry).decode())
        local = value(samples, "pagevis_kv_cache_layer_usage_ratio", engine="sessions", layers=f"local W={W}")
        global_ = value(samples, "pagevis_kv_cache_layer_usage_ratio", engine="sessions", layers="global")
        assert local == pytest.approx((held[0] + held[1]) / (2 * capacity))
        assert global_ == pytest.approx(held[2] / capacity)
        assert value(samples, "pagevis_kv_cache_usage_ratio") == pytest.approx(sum(held) / (3 * capacity))
        seen_apart |= held[0] < held[2]
    assert seen_apart
    observer.close()
    assert not any(name == "pagevis_kv_cache_layer_usage_ratio" for name, _ in scrape(
        generate_latest(metrics.registry).decode()))

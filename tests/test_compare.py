"""`pagevis compare`: full-cache perplexity equals a direct dense computation, and the per-token oracle
metrics agree with the decoding session's own full-cache oracle."""

import csv
import json
import os

import numpy as np
import pytest

from pagevis.__main__ import main
from pagevis.quality import measure
from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
from pagevis.engine.sampling import log_softmax
from pagevis.model import DenseAttention

SPEC = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=2)
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be.")


def dense_perplexity(model, ids):
    logits = model.forward(np.array(ids), np.arange(len(ids)), DenseAttention(model.config), all_logits=True)
    logprobs = [log_softmax(logits[i])[ids[i + 1]] for i in range(len(ids) - 1)]
    return float(np.exp(-np.mean(logprobs)))


@pytest.fixture(scope="module")
def model():
    return SPEC.load()


@pytest.fixture(scope="module")
def ids(model):
    return model.tokenizer.encode(TEXT)[:120]


@pytest.fixture(scope="module")
def reference(model, ids):
    with measure.full_reference(model, ids, page_size=8, chunk=50) as reference:
        yield reference


def test_full_cache_perplexity_equals_dense(model, ids, reference):
    expected = dense_perplexity(model, ids)
    assert reference.perplexity() == pytest.approx(expected, rel=1e-5)
    row = measure.evaluate(model, reference, measure.PolicyChoice("none"), budget=128, page_size=8)
    assert row.ppl == pytest.approx(expected, rel=1e-5)
    assert row.evictions == 0 and row.evicting_tokens == 0


def test_a_budget_prefilled_in_pieces_equals_one_chunk(model, reference):
    """compare prefills in pieces to bound memory: the rows are those of one whole chunk."""
    rows = [measure.evaluate(model, reference, measure.PolicyChoice("h2o"), budget=48, page_size=8, piece=piece)
            for piece in (1000, 7)]
    assert rows[0].ppl == pytest.approx(rows[1].ppl, rel=1e-6)
    assert rows[0].mean_kl == pytest.approx(rows[1].mean_kl, rel=1e-5, abs=1e-9)
    assert rows[0].evictions == rows[1].evictions


def test_policy_none_below_the_text_reports_cache_full(model, reference):
    row = measure.evaluate(model, reference, measure.PolicyChoice("none"), budget=64, page_size=8)
    assert row.ppl is None and "cache full" in row.note


@pytest.mark.parametrize("policy", ["sinks", "oldest", "h2o", "tova", "snapkv"])
def test_metrics_agree_with_the_session_oracle(model, ids, reference, policy):
    budget = 48
    row = measure.evaluate(model, reference, measure.PolicyChoice(policy), budget=budget, page_size=8)
    session = DecodeSession(model, "", SessionConfig(page_size=8, max_pages=budget // 8, policy=policy,
                                                     max_new_tokens=1, oracle=True, chat=False, record_layers=()),
                            prompt_ids=ids)
    scored = [r.oracle for r in session.run() if budget <= r.positions[-1] < len(ids) - 1]
    # once full, the session feeds one token per step, so its oracle scores every token we average over
    assert len(scored) == row.evicting_tokens == len(ids) - 1 - budget
    assert row.mean_kl == pytest.approx(np.mean([o.kl for o in scored]), rel=1e-3, abs=1e-6)
    assert row.mean_kl > 1e-4, "the cache should lose something"
    assert row.top1_agreement == pytest.approx(np.mean([o.top1_agree for o in scored]))
    assert row.lost_attention == pytest.approx(np.mean([o.lost_attention for o in scored]), rel=1e-2, abs=1e-4)
    assert row.ppl_evicting == pytest.approx(np.exp(-np.mean([o.logprob_bounded for o in scored])), rel=1e-4)
    assert row.full_ppl_evicting == pytest.approx(np.exp(-np.mean([o.logprob_full for o in scored])), rel=1e-4)


def test_cli_json_csv_and_plot(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    status = main(["compare", str(text), "--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--model-seed", "2", "--policies", "sinks,none,sinks:n_sink=0",
                   "--budgets", "32,192", "--page-size", "16", "--tokens", "100", "--json",
                   "--csv", str(tmp_path / "c.csv"), "--plot", str(tmp_path / "c.png"), "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    result = json.loads(out)
    raw = SPEC.load()
    expected = dense_perplexity(raw, raw.tokenizer.encode(TEXT)[:100])
    assert result["full_cache_ppl"] == pytest.approx(expected, rel=1e-3)
    rows = {(r["policy"], r["budget"]): r for r in result["rows"]}
    assert rows[("none", 192)]["ppl"] == pytest.approx(expected, rel=1e-3)
    assert rows[("none", 32)]["ppl"] is None
    assert rows[("sinks(n_sink=0)", 32)]["evictions"] > 0
    with open(tmp_path / "c.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 1 + 4 * 2  # optimal is added
    assert rows[("optimal", 32)]["gap_to_optimal"] == 0.0
    assert rows[("sinks", 32)]["gap_to_optimal"] == pytest.approx(
        rows[("sinks", 32)]["ppl_evicting"] / rows[("optimal", 32)]["ppl_evicting"] - 1)
    assert rows[("none", 32)]["gap_to_optimal"] is None
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "30"], "30 is not a positive multiple of --page-size 16"),
    (["--policies", "lru2"], "unknown policy 'lru2'"),
    (["--policies", "optimal:x=1"], "unknown policy 'optimal'"),
    (["--tmp-dir", "/no/such/dir"], "--tmp-dir /no/such/dir: no such folder"),
    (["--policies", "sinks:n_sink"], "expected KEY=VALUE"),
    (["--policies", "sinks:n_sink=64", "--budgets", "32"], "--policies sinks(n_sink=64) at budget 32: sinks.n_sink"),
    (["/no/such/text.txt"], "TEXTFILE /no/such/text.txt: no such file"),
    (["--tokens", "1"], "--tokens 1"),
])
def test_bad_arguments(argv, message, capsys):
    assert main(["compare", "--model", "synthetic", "--no-files", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_pyramidkv_row_holds_its_mean_budget(model, reference):
    """compare's pyramidkv at budget B: per-layer budgets with mean B, in a pool that holds layer 0's share."""
    choice = measure.PolicyChoice("pyramidkv", {"window": 4})
    max_pages, params = measure.session_pages(choice, 32, 8)
    assert params["budget"] == 32 and max_pages * 8 >= 60
    row = measure.evaluate(model, reference, choice, budget=32, page_size=8)
    assert row.ppl is not None and row.evictions > 0


def test_reference_streams_to_files_and_leaves_none(model, ids, tmp_path):
    """The reference keeps O(T) in memory; its files hold what a dense pass computes, and have no name."""
    logits, weights = dense_logits_and_attention(model, ids)
    with measure.full_reference(model, ids, page_size=8, chunk=37, folder=str(tmp_path)) as reference:
        for p in (0, 1, 36, 37, 80, len(ids) - 2):
            assert np.allclose(reference.logprobs(p), log_softmax(logits[p]), atol=1e-5)
            assert np.allclose(reference.attention(p), weights[:, p, : p + 1], atol=2e-3)
        rows = np.stack([np.pad(reference.attention(p), ((0, 0), (0, len(ids) - p - 1))) for p in range(len(ids) - 1)])
        assert np.allclose(reference.attention_totals, rows.sum(axis=0), atol=1e-9)
        assert reference.top1.tolist() == np.argmax(logits[:-1], axis=1).tolist()
        assert os.listdir(tmp_path) == []


def dense_logits_and_attention(model, ids):
    """Logits and head-mean attention (layers, T, T) of a plain dense pass, float64 attention by hand."""
    captured = {}
    dense = DenseAttention(model.config)

    def attend(layer, q, k, v, positions):
        out = dense(layer, q, k, v, positions)
        captured[layer] = (q, k)
        return out

    logits = model.forward(np.array(ids), np.arange(len(ids)), attend, all_logits=True)
    n, cfg = len(ids), model.config
    weights = np.zeros((cfg.n_layers, n, n))
    for layer, (q, k) in captured.items():
        group = cfg.n_heads // cfg.n_kv_heads
        for h in range(cfg.n_heads):
            scores = q[:, h].astype(np.float64) @ k[:, h // group].astype(np.float64).T / np.sqrt(cfg.head_dim)
            scores[np.triu_indices(n, 1)] = -np.inf
            e = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights[layer] += e / e.sum(axis=1, keepdims=True) / cfg.n_heads
    return logits, weights


def test_a_shipped_text_by_name():
    from pagevis.cli.compare import load_text

    text = load_text("pride-and-prejudice-ch1-6")
    assert text.startswith("Chapter I\n\nIt is a truth universally acknowledged") and len(text) > 40_000
    assert "Chapter VI" in text and "[Illustration" not in text and "_" not in text


def test_disk_row_is_exact_and_quest_recall_agrees_with_the_session_oracle(model, ids, reference):
    disk = measure.evaluate(model, reference, measure.PolicyChoice("disk"), budget=32, page_size=8)
    assert disk.ppl == pytest.approx(reference.perplexity(), rel=1e-5)  # every page read: exact
    assert disk.recall == pytest.approx(1.0) and disk.evictions == 0
    budget = 32
    row = measure.evaluate(model, reference, measure.PolicyChoice("quest"), budget=budget, page_size=8)
    settings = measure.tier_settings(measure.PolicyChoice("quest"), budget, 8, len(ids))
    assert settings == {"disk_pages": 15, "policy": "none", "select": "quest", "select_pages": 4}
    session = DecodeSession(model, "", SessionConfig(page_size=8, max_pages=budget // 8, max_new_tokens=1,
                                                     oracle=True, chat=False, record_layers=(), **settings),
                            prompt_ids=ids)
    recalls = [r.tiers.recall.mean() for r in session.run() if budget <= r.positions[-1] < len(ids) - 1]
    assert len(recalls) == row.evicting_tokens  # one token per step once past select_pages pages
    assert row.recall == pytest.approx(np.mean(recalls), rel=1e-2)
    assert 0.2 < row.recall < 0.999 and row.ppl != pytest.approx(reference.perplexity(), rel=1e-4)
    session.cache.close()


def test_estimate_and_progress_say_how_long(model):
    import io

    from pagevis.cli.progress import Progress

    estimate = measure.estimate_seconds(model, 1000, [64, 256])
    assert 0 < estimate.reference < estimate.total
    cfg = model.config
    assert estimate.disk_bytes == 999 * cfg.vocab_size * 4 + cfg.n_layers * 999 * 1000  # float32 rows + f16 triangle
    stream = io.StringIO()
    progress = Progress(100, "compare", enabled=True, stream=stream)
    progress.started -= 30  # 30 s in, a quarter done: about 90 s left
    progress.update(25, "sinks @ 64")
    assert "25/100 0:30 ~1:30 left sinks @ 64" in stream.getvalue()


def test_per_head_rows_hold_the_entries_of_their_budget(model, reference):
    """compare's adakv at budget B: n_kv x B entries per layer in a pool of n_kv x B slots (where its heads'
    tokens may spread); every layer's entries stay within the budget; lost attention is not claimed."""
    n_kv = model.config.n_kv_heads
    choice = measure.PolicyChoice("adakv", {})
    max_pages, params = measure.session_pages(choice, 32, 8, model.config)
    assert params["budget"] == 32 and max_pages * 8 == n_kv * 32
    row = measure.evaluate(model, reference, choice, budget=32, page_size=8)
    assert row.ppl is not None and row.evictions > 0 and row.lost_attention is None and "per-head" in row.note


@pytest.mark.parametrize("dtype,residual", [("int8", None), ("int4", 8), ("int2", 0)])
def test_quantized_rows_agree_with_the_session_oracle(model, ids, reference, dtype, residual):
    """A quantized row's KL and top-1 are the session's own oracle's (a float32 full cache) on the same tokens."""
    budget = 64
    row = measure.evaluate(model, reference, measure.PolicyChoice("tova"), budget=budget, page_size=8, dtype=dtype,
                           residual=residual)
    storage = {"dtype": dtype} if residual is None else {"dtype": dtype, "residual": residual}
    session = DecodeSession(model, "", SessionConfig(page_size=8, max_pages=budget // 8, policy="tova",
                                                     max_new_tokens=1, oracle=True, chat=False, record_layers=(),
                                                     **storage), prompt_ids=ids)
    scored = [r.oracle for r in session.run() if budget <= r.positions[-1] < len(ids) - 1]
    assert row.dtype == dtype and row.kv_bytes_per_token == session.cache_config.kv_bytes_per_token()
    assert row.mean_kl == pytest.approx(np.mean([o.kl for o in scored]), rel=1e-3, abs=1e-6)
    assert row.top1_agreement == pytest.approx(np.mean([o.top1_agree for o in scored]))
    assert row.ppl_evicting == pytest.approx(np.exp(-np.mean([o.logprob_bounded for o in scored])), rel=1e-4)


def test_cli_dtypes_and_equal_memory_rows(tmp_path, capsys):
    status = main(["compare", "--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                   "--head-dim", "16", "--model-seed", "2", "--policies", "sinks", "--no-optimal", "--budgets",
                   "32,64", "--page-size", "16", "--tokens", "150", "--dtypes", "float32,int8,int4", "--residual", "0",
                   "--equal-memory", "float16", "--json", "--no-files", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    result = json.loads(out)
    assert result["dtypes"] == ["float16", "float32", "int8", "int4"] and result["residual"] == 0
    grid = [r for r in result["rows"] if not r["equal_memory_to"]]
    assert sorted((r["dtype"], r["budget"]) for r in grid) == sorted(
        (d, b) for d in ("float16", "float32", "int8", "int4") for b in (32, 64))
    per_token = {"float32": 2 * 2 * 2 * 16 * 4, "float16": 2 * 2 * 2 * 16 * 2, "int8": 2 * 2 * 2 * (16 + 2)}
    for r in grid:  # 2 layers x 2 KV heads x head dim 16, counted by hand
        if r["dtype"] in per_token:
            assert r["kv_bytes_per_token"] == per_token[r["dtype"]]
        assert r["kv_bytes"] == round(r["kv_bytes_per_token"] * r["budget"])
    # int4: per layer and token 2 x 2 heads x 8 bytes of codes, 2 heads x 1 group x 2 x 2 bytes of V scales
    # and zero points, a 4-byte key group index, 2 x 16 x 2 x 2 / 32 bytes of key group; and the window's 32
    # float32 tokens at most (residual 0: the token just written and 31 waiting), 2 x 2 x 16 x 4 bytes each
    int4 = next(r for r in grid if r["dtype"] == "int4" and r["budget"] == 64)
    assert int4["kv_bytes_per_token"] == pytest.approx(2 * (32 + 8 + 4 + 4 + 32 * 2 * 2 * 16 * 4 / 64))
    float16 = {r["budget"]: r["kv_bytes"] for r in grid if r["dtype"] == "float16"}
    equal = [r for r in result["rows"] if r["equal_memory_to"]]
    assert {r["equal_memory_to"] for r in equal} == {"float16@32", "float16@64"}
    for r in equal:  # the most tokens within float16's bytes: one more page would not fit
        allowed = float16[int(r["equal_memory_to"].split("@")[1])]
        assert r["kv_bytes"] <= allowed
        bigger = measure.cache_bytes(r["dtype"], r["budget"] + 16, 16, 0, SPEC.load().config)
        assert bigger > allowed or r["budget"] + 16 > 160
    assert any(r["dtype"] == "int8" and r["budget"] > 64 for r in equal)


def test_bad_dtypes(capsys):
    assert main(["compare", "--model", "synthetic", "--no-files", "--dtypes", "float32,int3"]) == 2
    assert "--dtypes: unknown dtype 'int3'" in capsys.readouterr().err


def test_rows_beyond_dropping_tokens(model, reference):
    """compare's rows for re-rotation, periodic compression, threshold eviction and merging: each changes the
    perplexity of the plain policy it builds on, and the rows say how many tokens (and bytes) they held."""
    def row(name, **params):
        return measure.evaluate(model, reference, measure.PolicyChoice(name, params), budget=48, page_size=8)

    sinks, h2o = row("sinks"), row("h2o")
    assert sinks.mean_resident == h2o.mean_resident == 48 and sinks.kv_bytes_held == sinks.kv_bytes
    rotated = row("sinks", rerotate=1)
    assert rotated.ppl != pytest.approx(sinks.ppl, rel=1e-6) and rotated.evictions == sinks.evictions
    periodic = row("h2o", compress_every=8)  # full at 48, down to 40: between 41 and 48 after each write
    assert 41 <= periodic.mean_resident < 48 and periodic.ppl != pytest.approx(h2o.ppl, rel=1e-6)
    assert periodic.kv_bytes_held == round(periodic.mean_resident * periodic.kv_bytes_per_token)
    merged = row("merge")
    assert merged.evictions == h2o.evictions and merged.ppl != pytest.approx(h2o.ppl, rel=1e-6)
    floating = row("threshold", threshold_pct=100, window=8)  # below an even share: this model holds ~14
    assert floating.mean_resident < 48 and floating.kv_bytes_held < floating.kv_bytes


def test_the_header_and_rows_say_the_window_was_clamped(capsys):
    args = ["compare", "--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--model-seed", "2", "--policies", "sinks", "--no-optimal", "--budgets", "32", "--page-size", "16",
            "--tokens", "60", "--dtypes", "int4", "--residual", "128", "--no-files", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "int4 at 32: residual 128 clamped to 0" in out and "more than float32's 256" in out
    assert main([*args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["residual"] == 0 and "clamped to 0" in row["storage_notice"]

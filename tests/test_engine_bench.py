"""`pagevis bench engine`'s pieces (the bench itself is never timed here): its workers decode a small GGUF file as
`pagevis run` and as the bare model do, their per-part milliseconds add up to the token's wall time, and the ratios
and the report come from the rows."""

from __future__ import annotations

import pytest

from pagevis.bench import engine as bench
from pagevis.bench.synthetic_gguf import write_q4_k_m_gguf
from pagevis.cli import options
from pagevis.cli.main import main
from pagevis.model.weight_threads import set_weight_threads

TINY = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=1024)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    yield str(write_q4_k_m_gguf(tmp_path_factory.mktemp("engine-bench") / "tiny.gguf", TINY))
    set_weight_threads(None)  # the workers set one thread, as a worker process would


@pytest.mark.parametrize("worker", [bench.engine_worker, bench.model_worker])
def test_a_worker_decodes_and_its_parts_add_up_to_the_wall_time(tiny_file, worker):
    out = worker(tiny_file, 1, 3, (5, 40))
    for n in (5, 40):
        assert out[f"decode_{n}"] > 0 and out[f"prefill_{n}"] > 0 and out[f"peak_rss_{n}"] > 0
        if worker is bench.engine_worker:
            assert out[f"decode_cpu_{n}"] > 0
        split = out[f"split_{n}"]
        assert min(split[part] for part in ("weights", "attention", "forward_rest")) > 0
        assert sum(split[part] for part in bench.PARTS) == pytest.approx(split["wall"], rel=1e-6)
        if worker is bench.engine_worker:  # the session's own parts were seen
            assert split["record"] > 0 and split["bookkeeping"] > 0 and split["sampling"] > 0


def test_ratios_and_report_come_from_the_rows():
    def row(engine, threads, decode, rss):
        split = {part: 1.0 for part in bench.PARTS}
        return {"engine": engine, "threads": threads, "name": f"{engine} {threads}t", "decode_23": decode,
                "prefill_23": 100.0, "peak_rss_23": rss << 20, "split_23": dict(split, wall=7.0)}

    rows = [row("engine", 1, 40.0, 300), row("model", 1, 50.0, 250), row("llama.cpp", 1, 80.0, 200),
            row("engine", 2, 60.0, 300)]
    out = bench.ratios(rows, (23,))
    assert out["decode_23 engine/llama.cpp 1t"] == 0.5 and out["decode_23 engine/model 1t"] == 0.8
    assert out["peak_rss_23 engine/llama.cpp 1t"] == 1.5 and out["decode_23 engine 2t/1t"] == 1.5
    assert out["attention_23 engine/model 1t"] == 1.0
    report = bench.format_report({"cpu": "test CPU x2", "load_before": (1.0,), "load_after": (1.5,), "prompts": [23],
                                  "decode_tokens": 8, "llama_cpp": True,
                                  "models": [{"model": "m", "path": "/x/m.gguf", "rows": rows, "ratios": out}]})
    assert "decode_23 engine/llama.cpp 1t: 0.50" in report and "after   23: wall 7.00 = weights 1.00" in report


@pytest.mark.parametrize("argv, message", [
    (["bench", "engine", "--thread-counts", "3"], "--thread-counts '3': 1, 2 or 1,2"),
    (["bench", "engine", "--prompts", "0"], "--prompts '0': each must be from 1 to 32768"),
    (["bench", "engine", "--models", "nowhere.gguf"], "--models: nowhere.gguf: smollm2, gemma3-270m or the path"),
    (["bench", "weights", "--rounds", "0"], "--rounds 0: must be from 1 to 20"),
])
def test_the_subcommands_refuse_bad_options_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("policy, params", [("h2o", {}), ("sinks", {"compress_every": 8})])
def test_the_policy_worker_times_decode_steps_with_the_cache_full(tiny_file, policy, params):
    # the prompt overflows the cache: it is prefilled in chunks (of 8 with compress_every=8) before the first token,
    # and none of those chunks is timed as decoding
    out = bench.engine_worker(tiny_file, 1, 3, (300,), policy=policy, policy_params=params)
    assert out["decode_300"] > 0 and out["timed_decode_steps_300"] == 3
    split = out["split_300"]
    assert sum(split[part] for part in bench.PARTS) == pytest.approx(split["wall"], rel=1e-6)


def test_a_policy_with_a_parameter_is_run_with_it():
    assert options.parse_policy_item("expected-attention:compress_every=1", "--policies") == (
        "expected-attention", {"compress_every": 1})
    every = next(p for p in bench.TOKEN_POLICIES if p.label == "expected-attention:compress_every=1")
    config = bench.policy_config(every.name, every.params, 8)
    assert config.policy == "expected-attention" and dict(config.policy_params) == {"compress_every": 1}
    assert dict(bench.policy_config("expected-attention", {}, 8).policy_params) == {}


def test_the_policy_report_states_each_rate_over_sinks_in_the_same_round(monkeypatch, tiny_file):
    rates = iter([10.0, 5.0, 8.0, 8.0])  # round 1: sinks, h2o; round 2: sinks, h2o

    def worker(config, path, decode, prompts):
        rate = next(rates)
        return {"decode_512": rate, "decode_cpu_512": 2 * rate, "prefill_512": 1.0, "peak_rss_512": 1 << 20,
                "split_512": {part: 1.0 for part in ("wall", *bench.PARTS)}}

    monkeypatch.setattr(bench, "run_worker", worker)
    result = bench.run_policy_bench(2, 4, tiny_file, (bench.plain("h2o"),), say=lambda text: None)
    h2o = next(row for row in result["rows"] if row["name"] == "h2o")
    assert h2o["over_sinks_rounds"] == [0.5, 1.0] and h2o["over_sinks"] == 0.75 and h2o["over_sinks_cpu"] == 0.75
    assert "h2o" in bench.format_policy_report(result) and "0.75x" in bench.format_policy_report(result)


@pytest.mark.parametrize("argv, message", [
    (["bench", "engine", "--policies", "sinks,nothing"], "--policies: nothing: all, or names from"),
    (["bench", "engine", "--policies", "all", "--prompts", "100"], "--prompts 100: with --policies, more than"),
    (["bench", "engine", "--policies", "sinks:n_sink"], "--policies 'n_sink': expected KEY=VALUE"),
    (["bench", "engine", "--policies", "sinks,nothing:n_sink=4"], "--policies: nothing:n_sink=4: all, or names from"),
    (["bench", "engine", "--policies", "sinks:n_sink=x"], "sinks.n_sink = 'x' is not allowed"),
])
def test_the_policy_bench_refuses_bad_options_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err

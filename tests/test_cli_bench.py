"""`pagevis bench --quick`: runs, prints one JSON object with every table, writes CSVs and PNGs.
Not a timed test: it checks the shape of the report, never the speed."""

import json

import pytest

from pagevis.__main__ import main

from model_fixtures import smollm2  # noqa: F401  (fixture)


def test_bench_quick_json_and_files(tmp_path, capsys):
    status = main(["bench", "--quick", "--contexts", "32,64", "--page-sizes", "8,16", "--model", "synthetic",
                   "--layers", "1", "--decode-tokens", "3", "--json", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    result = json.loads(out)
    assert {(r["context"], r["page_size"]) for r in result["attention"]} == {(32, 8), (32, 16), (64, 8), (64, 16)}
    assert all(r["ratio"] > 0 for r in result["attention"])
    assert [r["context"] for r in result["storage"]] == [32, 64]
    assert result["storage"][0]["f16_kv_bytes"] * 2 == result["storage"][0]["f32_kv_bytes"]
    decode = result["decode"]
    assert decode["floor_tok_s"] > 0 and decode["paged_tok_s"] > 0 and decode["decode_steps"] == 3
    # the floor is read bandwidth over weight bytes; a copy (each byte counted once) is only shown beside it
    assert decode["floor_tok_s"] == pytest.approx(decode["read_gb_s"] * 1e3 / decode["weight_mb_per_token"])
    assert decode["read_gb_s"] == max(decode["gemv_gb_s"], decode["reduce_gb_s"]) and decode["copy_tok_s"] > 0
    assert decode["paged_of_floor"] == pytest.approx(decode["paged_tok_s"] / decode["floor_tok_s"])
    for name in ("bench-attention.csv", "bench-storage.csv", "bench-decode.csv"):
        assert (tmp_path / name).read_text().count("\n") >= 2
    for name in ("bench-latency.png", "bench-memory.png", "bench-tiers.png", "bench-quest.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    tiers = result["tiers"]  # the disk tier: exact streamed reads at several RAM shares, quest by K
    assert tiers["streamed"] and all(r["context"] == 64 and r["warm_us"] > 0 and r["hit_rate"] < 1
                                     for r in tiers["streamed"])
    assert tiers["quest"] and all(r["quest_us"] > 0 for r in tiers["quest"]) and tiers["rss"] is None
    # what it ran on, beside every table: the CPU, the BLAS build, the load while each table was measured
    assert result["machine"]["cpu"] and result["machine"]["cores"] >= 1 and "BLAS" not in result["machine"]["numpy"]
    assert {"attention", "storage", "quantized", "decode", "tiers"} <= set(result["loads"])
    from pagevis.cli.bench import format_report

    report = format_report(result)
    assert report.startswith(f"Machine: {result['machine']['cpu']}") and report.count("(load ") >= 5


def test_bench_table_without_model_or_files(capsys):
    assert main(["bench", "--quick", "--contexts", "32", "--no-model", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert "paged/dense" in out and "f16/f32" in out and "Decode speed" not in out


def test_bench_bad_arguments(capsys):
    assert main(["bench", "--contexts", "32,abc"]) == 2
    assert "--contexts '32,abc': expected numbers" in capsys.readouterr().err
    assert main(["bench", "--out", "/no/such/folder", "--no-model"]) == 2
    assert "--out /no/such/folder: no such folder" in capsys.readouterr().err
    assert main(["bench", "--quick", "--no-files", "--contexts", "32", "--transformers-python", "/no/python"]) == 2
    assert "--transformers-python /no/python: not an executable" in capsys.readouterr().err


def test_transformers_row_reads_the_script_json(tmp_path):
    """The transformers benchmark runs in another interpreter; a stand-in prints what the script prints."""
    from pagevis.bench.suite import transformers_row
    from pagevis.engine import ModelSpec

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"tokens_per_s\": 4.5, \"tokens\": 8, \"threads\": 2, \"versions\": {}}'\n")
    fake.chmod(0o755)
    assert transformers_row(ModelSpec(), str(fake), 8, threads=1)["tokens_per_s"] == 4.5
    assert transformers_row(ModelSpec(kind="synthetic"), str(fake), 8, threads=1) is None


def test_torch_sdpa_rows_on_the_same_data():
    """Runs only where torch is installed (make torch); skipped otherwise. torch_rows itself checks that torch
    and the engine agree on every context; here: both dtypes are measured and each row's K/V size is right."""
    pytest.importorskip("torch")
    from pagevis.bench import suite

    rows = suite.torch_rows([16, 40], page_size=8, repeats=2, threads=1)
    assert [(r["dtype"], r["context"]) for r in rows] == [("float32", 16), ("float32", 40), ("float16", 16),
                                                        ("float16", 40)]
    assert all(r["torch_us"] > 0 and r["paged_over_torch"] > 0 and r["torch_threads"] == 1 for r in rows)
    assert rows[1]["kv_bytes"] == 2 * 40 * 3 * 64 * 4 == 2 * rows[3]["kv_bytes"]


def test_decode_share_above_the_read_floor_is_flagged(monkeypatch, capsys):
    """A decode faster than the read bandwidth allows is impossible: the report says so."""
    from pagevis.bench import suite
    from pagevis.cli.bench import format_report
    from pagevis.engine import ModelSpec
    from pagevis.bench import bandwidth as speed

    monkeypatch.setattr(speed, "measure_read_bandwidth", lambda nbytes: {"gemv": 1e3, "reduce": 1e3, "read": 1e3})
    row = suite.decode_row(ModelSpec(kind="synthetic", n_layers=1), n_tokens=2, probe_bytes=1 << 20)
    assert row["paged_of_floor"] > 1 and len(row["warnings"]) == 2
    report = format_report({"attention": [], "storage": [], "torch": None, "decode": row})
    assert "WARNING: paged decoding at" in report and "impossible" in report


@pytest.mark.slow
def test_bench_serve_at_concurrencies_and_poisson_rates(tmp_path, capsys):
    """`pagevis bench serve` end to end on the synthetic model (a server process of its own): every request
    completes, the table and plot are written, and a Poisson run at a rate works too."""
    from pagevis.bench import serving

    assert main(["bench", "serve", "--model", "synthetic", "--concurrency", "2", "--request-rate", "20",
                 "--num-prompts", "4", "--output-tokens", "3", "--dtype", "float16", "--out", str(tmp_path),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["server_flags"][-2:] == ["--dtype", "float16"]  # the server's K/V storage, as given
    assert [level.get("concurrency", level.get("rate")) for level in result["levels"]] == [2, 20.0]
    assert all(level["completed"] == level["requests"] == 4 and level["output_tokens"] == 12
               for level in result["levels"])
    assert all(level["system_prompt_hit_min"] > 0.9 for level in result["levels"])
    # the server process's own CPU time (clock ticks: some in 4 requests), per output token
    assert all(level["server_cpu_s"] > 0 and level["cpu_ms_per_token"] == pytest.approx(1e3 * level["server_cpu_s"] / 12)
               for level in result["levels"])
    assert (tmp_path / "bench-serve.png").stat().st_size > 0
    table = serving.format_table(result)
    assert "c=2" in table and "20/s" in table and "system prompt tokens from the prefix cache" in table


def test_eight_clients_over_one_is_of_the_medians_by_wall_clock_and_by_cpu():
    from pagevis.bench.serving import eight_over_one

    levels = [{"concurrency": c, "output_throughput": t, "cpu_ms_per_token": cpu}
              for c, t, cpu in ((1, 40.0, 12.0), (8, 90.0, 6.0), (1, 50.0, 10.0), (8, 150.0, 5.0), (1, 20.0, 11.0),
                                (8, 100.0, 4.0), (2, 70.0, None))]
    assert eight_over_one(levels) == {"c8_over_c1": 100.0 / 40.0, "c8_over_c1_cpu": 11.0 / 5.0}
    assert eight_over_one([dict(level, cpu_ms_per_token=None) for level in levels]) == {"c8_over_c1": 2.5}
    assert eight_over_one(levels[:1]) == {}


def test_a_bench_server_that_does_not_start_in_time_is_stopped(monkeypatch):
    """A server the bench gives up on is not left running (a `with` whose __enter__ raises never exits)."""
    from pagevis.bench import serve

    monkeypatch.setattr(serve, "START_SECONDS", 0.0)
    server = serve.ServerProcess("synthetic")
    with pytest.raises(RuntimeError, match="did not start within 0 s"):
        with server:
            pass
    assert server.process.poll() is not None


def test_bench_serve_bad_arguments(capsys):
    assert main(["bench", "serve", "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "some.gguf"]) == 2
    assert main(["bench", "serve", "--rounds", "0"]) == 2


def test_the_read_rate_by_shape_measures_weights_kept_as_the_gguf_stores_them(smollm2):  # noqa: F811
    """The decode row's read rates on today's default weights (`pagevis bench` failed: 'QuantMatrix' has no T):
    each shape through its packed kernel, no float32 gemv to compare with."""
    from pagevis.bench.bandwidth import shape_read_rates

    rows = shape_read_rates(smollm2, repeats=1)
    assert {r["kernel"] for r in rows} <= {"u4", "u5", "i8"} and len(rows) == 5
    assert all(r["forward_gb_s"] > 0 and r["gemv_gb_s"] is None for r in rows)
    assert sum(r["mb"] for r in rows) * 1e6 == pytest.approx(sum(w.nbytes for w in smollm2.weights.matrices()))

"""`pagevis bench --quick`: runs, prints one JSON object with every table, writes CSVs and PNGs.
Not a timed test: it checks the shape of the report, never the speed."""

import json

from pagevis.__main__ import main


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
    for name in ("bench-attention.csv", "bench-storage.csv", "bench-decode.csv"):
        assert (tmp_path / name).read_text().count("\n") >= 2
    for name in ("bench-latency.png", "bench-memory.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_table_without_model_or_files(capsys):
    assert main(["bench", "--quick", "--contexts", "32", "--no-model", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert "paged/dense" in out and "f16/f32" in out and "Decode speed" not in out


def test_bench_bad_arguments(capsys):
    assert main(["bench", "--contexts", "32,abc"]) == 2
    assert "--contexts '32,abc': expected numbers" in capsys.readouterr().err
    assert main(["bench", "--out", "/no/such/folder", "--no-model"]) == 2
    assert "--out /no/such/folder: no such folder" in capsys.readouterr().err

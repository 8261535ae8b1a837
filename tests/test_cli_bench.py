"""`pagevis bench --quick`: runs, prints one JSON object with every table, writes CSVs and PNGs.
Not a timed test: it checks the shape of the report, never the speed."""

import json
import sys

import numpy as np

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
    assert main(["bench", "--quick", "--no-files", "--contexts", "32", "--transformers-python", "/no/python"]) == 2
    assert "--transformers-python /no/python: not an executable" in capsys.readouterr().err


def test_transformers_row_reads_the_script_json(tmp_path):
    """The transformers benchmark runs in another interpreter; a stand-in prints what the script prints."""
    from pagevis.bench.suite import transformers_row
    from pagevis.decoding import ModelSpec

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"tokens_per_s\": 4.5, \"tokens\": 8, \"threads\": 2, \"versions\": {}}'\n")
    fake.chmod(0o755)
    assert transformers_row(ModelSpec(), str(fake), 8, threads=1)["tokens_per_s"] == 4.5
    assert transformers_row(ModelSpec(kind="synthetic"), str(fake), 8, threads=1) is None


class FakeTensor:
    """Just enough of a torch tensor for pagevis.bench.suite.torch_rows, backed by NumPy."""

    def __init__(self, array):
        self.array = array

    def unsqueeze(self, dim):
        return FakeTensor(np.expand_dims(self.array, dim))

    def __getitem__(self, index):
        return FakeTensor(self.array[index])

    def numpy(self):
        return self.array


def fake_sdpa(q, k, v):
    scores = q.array @ k.array.swapaxes(-1, -2) / np.sqrt(q.array.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return FakeTensor(weights @ v.array)


def test_torch_rows_use_the_same_data(monkeypatch):
    """torch is optional and not installed here: check the glue (layout, GQA, agreement check) against a
    NumPy stand-in with torch's calling convention."""
    import contextlib
    import types

    from pagevis.bench import suite

    functional = types.SimpleNamespace(scaled_dot_product_attention=fake_sdpa)
    nn = types.ModuleType("torch.nn")
    nn.functional = functional
    torch = types.ModuleType("torch")
    torch.nn = nn
    torch.from_numpy = FakeTensor
    torch.no_grad = contextlib.nullcontext
    torch.get_num_threads = lambda: 1
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.nn", nn)
    monkeypatch.setitem(sys.modules, "torch.nn.functional", functional)
    assert suite.torch_available()
    rows = suite.torch_rows([16, 40], page_size=8, repeats=2)
    assert [r["context"] for r in rows] == [16, 40]
    assert all(r["torch_us"] > 0 and r["paged_over_torch"] > 0 for r in rows)

"""The weights bench's pieces: the synthetic Q4_K_M file it writes loads and decodes the same with its weights kept
packed as dequantised to float32, and the ratios it prints are the ones its rows give."""

from __future__ import annotations

import numpy as np

from pagevis.bench.synthetic_gguf import write_q4_k_m_gguf
from pagevis.bench.weights import format_report, ratios
from pagevis.model import DenseAttention, load_model

TINY = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=400)


def test_the_synthetic_q4_k_m_file_decodes_alike_packed_and_as_float32(tmp_path):
    path = write_q4_k_m_gguf(tmp_path / "tiny.gguf", TINY)
    packed, dense = load_model(path), load_model(path, weights="float32")
    assert packed.weight_info["types"] == {"F32": 5, "Q4_K": 12, "Q6_K": 3}
    assert packed.weight_info["bytes"] < dense.weight_info["bytes"] / 3
    ids = np.array([300, 301, 302, 7])
    got = packed.forward(ids, np.arange(4), DenseAttention(packed.config), all_logits=True)
    want = dense.forward(ids, np.arange(4), DenseAttention(dense.config), all_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_ratios_and_report_come_from_the_rows():
    rows = [{"name": "pagevis quantized 1t", "weights": "quantized", "decode_23": 60.0, "decode_512": 50.0,
             "prefill_512": 150.0, "peak_rss": 250 << 20, "batch_8": 200.0, "batch_16": 300.0, "load_s": 1.0,
             "floor_tok_s": 100.0, "read_gb_s": 11.0, "weights_info": {"types": {"Q4_1": 1}, "bytes": 10**8},
             "memory": {"imports": 45 << 20, "kernels": 110 << 20, "weights": 96 << 20,
                        "tokenizer_and_rest": 20 << 20, "load_peak": 280 << 20}},
            {"name": "pagevis float32 1t", "weights": "float32", "decode_23": 20.0, "decode_512": 18.0,
             "prefill_512": 190.0, "peak_rss": 900 << 20, "batch_8": 100.0, "batch_16": 150.0, "load_s": 2.0},
            {"name": "llama.cpp 1t", "decode_23": 80.0, "decode_512": 70.0, "prefill_512": 170.0,
             "peak_rss": 200 << 20, "load_s": 0.5}]
    out = ratios(rows)
    assert out["decode_23 vs llama.cpp 1t"] == 0.75 and out["peak RSS vs llama.cpp 1t"] == 1.25
    assert out["decode_23 1t vs float32"] == 3.0 and out["batch_16 1t vs float32"] == 2.0
    report = format_report({"cpu": "test CPU x2", "load_before": (1.0,), "load_after": (1.2,),
                            "models": [{"model": "m", "path": "/x/m.gguf", "rows": rows, "ratios": out}]})
    assert "decode_23 vs llama.cpp 1t: 0.75" in report and "read floor 100.0 tok/s" in report
    assert ("pagevis quantized 1t memory (MiB): imports 45, kernels 110, weights 96, tokenizer and rest 20, "
            "load peak 280") in report


def test_the_status_bar_names_the_weight_types_and_bytes():
    from pagevis.gui.session.lifecycle import weights_text

    assert weights_text({"format": "quantized", "types": {"F32": 61, "Q4_1": 210, "Q8_0": 1},
                         "bytes": 111_617_280}) == "Q4_1+Q8_0 · 112 MB"
    assert weights_text({"format": "float32", "types": {"Q4_1": 210}, "bytes": 651_306_240}) == "float32 · 651 MB"


def test_the_kernels_by_type_count_every_packed_matrix_once(tmp_path):
    from pagevis.bench.weight_types import format_rates, packed_matrices, type_rates

    model = load_model(write_q4_k_m_gguf(tmp_path / "tiny.gguf", TINY))
    matrices = packed_matrices(model.weights)
    rates = type_rates(model.weights, reps=2)
    assert set(rates) == {label for label, _ in matrices} and set(rates) >= {"Q4_K", "Q6_K"}
    for label, entry in rates.items():  # every byte of that type's matrices, each matrix once
        assert entry["bytes"] == sum(m.nbytes for name, m in matrices if name == label) == entry["mb"] * 1e6
        assert entry["ms"] > 0 and entry["gb_s"] == entry["mb"] / entry["ms"]
    assert sum(m.nbytes for _, m in matrices) <= model.weight_info["bytes"]
    line = format_rates(rates, 30.0)
    assert all(label in line for label in rates) and "30.0 GB/s" in line

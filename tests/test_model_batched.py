"""The small-batch products and the batched forward against float64 references that share no code with them.

Speed is measured in `pagevis bench`, never here: these tests only check numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import lru_cache

import numpy as np
import pytest

from pagevis.model import DenseAttention, load_model
from pagevis.model import matmul as matmul_module
from pagevis.model.quant_weights import QuantEmbedding
from pagevis.model.quantized import QuantMatrix
from pagevis.model.matmul import GEMM, GEMM_ONLY, Kernel, MatmulPlan, candidates, matmul, plan_for, product
from pagevis.model.synthetic import SyntheticModel
from pagevis.model.weights import as_input_major

from model_fixtures import smollm2  # noqa: F401  (fixture)

ROWS = range(1, 18)
# SmolLM2-135M's matrices as (in, out): fused QKV, output projection, fused gate/up, down, vocabulary.
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def output_major(rng, n_in, n_out):
    """A random (in, out) weight laid out as the model lays it out: the view of an (out, in) array."""
    return as_input_major(rng.standard_normal((n_out, n_in), dtype=np.float32))


def assert_close_to_float64(x, w, got):
    """Each entry within 1e-5 of the float64 product, relative to sum |x||w| (the scale rounding works on)."""
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert got.shape == exact.shape and got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= 1e-5 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES[:4])
def test_every_kernel_matches_float64_for_1_to_17_rows(shape):
    rng = np.random.default_rng(sum(shape))
    w = output_major(rng, *shape)
    kernels = candidates(shape[1])
    assert len(kernels) > 4 and kernels[0] == GEMM
    for m in ROWS:
        x = rng.standard_normal((m, shape[0]), dtype=np.float32)
        for kernel in kernels:
            assert_close_to_float64(x, w, product(x, w, kernel))


@pytest.mark.slow
def test_every_kernel_matches_float64_on_the_vocabulary_projection():
    """576 x 49152 cut to its first 3072 output columns (every candidate block divides both)."""
    rng = np.random.default_rng(1)
    w = output_major(rng, 576, 3072)
    assert candidates(3072) == candidates(49152)
    for m in ROWS:
        x = rng.standard_normal((m, 576), dtype=np.float32)
        for kernel in candidates(3072):
            assert_close_to_float64(x, w, product(x, w, kernel))


@lru_cache(maxsize=1)
def smollm2_float32():
    """SmolLM2 with its matrices dequantised to float32 (--weights float32): the path the matmul plans serve."""
    return load_model(weights="float32")


@pytest.mark.slow  # ~7 s (SmolLM2 in float32); 918cbef meant it slow, but its mark landed on smollm2_float32
def test_smollm2_plan_matches_float64_on_its_own_weights():
    """The kernels load_model measured and chose, on the real matrices of one layer and the output."""
    model = smollm2_float32()
    layer = model.weights.layers[7]
    matrices = [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, model.weights.output_t]
    assert sorted(w.shape for w in matrices) == sorted(SMOLLM2_SHAPES)
    assert set(SMOLLM2_SHAPES) <= set(model.plan.table)
    rng = np.random.default_rng(2)
    for m in ROWS:
        for w in matrices:
            x = rng.standard_normal((m, w.shape[0]), dtype=np.float32)
            assert_close_to_float64(x, w, matmul(x, w, model.plan))


def test_a_block_that_does_not_divide_or_a_c_contiguous_weight_falls_back_to_gemm():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 40), dtype=np.float32)
    for w in (output_major(rng, 40, 96), np.ascontiguousarray(output_major(rng, 40, 96))):
        assert_close_to_float64(x, w, product(x, w, Kernel(64, "xw")))
        assert_close_to_float64(x, w, product(x, w, Kernel(32, "wx")))


def test_plan_picks_the_kernel_of_the_next_calibrated_row_count_and_gemm_past_the_last():
    plan = MatmulPlan({(8, 64): ((1, Kernel(32, "xw")), (4, Kernel(16, "wx")), (8, GEMM), (16, Kernel(16, "xw")))})
    assert [str(plan.kernel((8, 64), m)) for m in (1, 2, 4, 5, 8, 9, 16, 17)] == [
        "xw32", "wx16", "wx16", "gemm", "gemm", "xw16", "xw16", "gemm"]
    assert plan.kernel((8, 65), 2) == GEMM  # a shape it was not calibrated for
    assert plan.crossover((8, 64)) == 8
    assert MatmulPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


class QuietWatch(matmul_module.CpuWatch):
    """A CPU watch that saw no other process: the test machine may be busy, and a plan measured under load is
    measured again once the machine is quiet (tested below), which these tests must not depend on."""

    def __exit__(self, *exc):
        self.share = 0.0


def test_plan_for_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(matmul_module, "CpuWatch", QuietWatch)
    rng = np.random.default_rng(4)
    matrices = [output_major(rng, 32, 192) for _ in range(3)] + [output_major(rng, 64, 32)]
    path = tmp_path / "plans.json"
    plan = plan_for(matrices, path)
    assert set(plan.table) == {(32, 192), (64, 32)} and path.exists()
    for shape, entries in plan.table.items():
        assert [rows for rows, _ in entries][:4] == [1, 2, 3, 4]
        assert all(kernel in candidates(shape[1]) for _, kernel in entries)

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached plan should have been used")

    real_calibrate = matmul_module.calibrate

    monkeypatch.setattr("pagevis.model.matmul.calibrate", no_measuring)
    assert plan_for(matrices, path) == plan
    path.write_text("not json")  # a broken cache only costs a measurement
    monkeypatch.setattr("pagevis.model.matmul.calibrate", real_calibrate)
    assert set(plan_for(matrices, path).table) == set(plan.table)


# --- the batched forward ------------------------------------------------------------------------------


def reference_logits(weights64: dict, config, tokens) -> np.ndarray:
    """Float64 logits of the last token of `tokens`: a plain Llama forward (dense causal attention, RoPE on
    adjacent pairs as GGUF lays Q and K out) written here from the formulas, sharing no code with pagevis."""
    c = config
    x = weights64["embedding"][tokens]
    n, hd = len(tokens), c.head_dim
    angles = np.arange(n)[:, None] * c.rope_base ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(t):
        out = np.empty_like(t)
        out[..., 0::2] = t[..., 0::2] * cos - t[..., 1::2] * sin
        out[..., 1::2] = t[..., 0::2] * sin + t[..., 1::2] * cos
        return out

    def norm(t, gain):
        return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + c.rms_eps) * gain

    group = c.n_heads // c.n_kv_heads
    causal = np.tril(np.ones((n, n), dtype=bool))
    for layer in weights64["layers"]:
        qkv = norm(x, layer["attn_norm"]) @ layer["wqkv"]
        q = rope(qkv[:, :c.q_dim].reshape(n, c.n_heads, hd))
        k = rope(qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, hd))
        v = qkv[:, c.q_dim + c.kv_dim:].reshape(n, c.n_kv_heads, hd)
        out = np.empty((n, c.n_heads, hd))
        for h in range(c.n_heads):
            scores = q[:, h] @ k[:, h // group].T / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
        x = x + out.reshape(n, c.q_dim) @ layer["wo"]
        gate, up = np.split(norm(x, layer["ffn_norm"]) @ layer["w_gate_up"], 2, axis=1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ layer["w_down"]
    return norm(x[-1], weights64["output_norm"]) @ weights64["output_t"]


def as_float64(weight) -> np.ndarray:
    """A weight as float64: a matrix kept as the GGUF stores it dequantised tile by tile (its kernels are checked
    against gguf-py's dequantiser in test_weight_kernels.py), a quantised embedding row by row."""
    if isinstance(weight, QuantMatrix):
        return weight.dequantize()[:, :weight.n_out].astype(np.float64)
    if isinstance(weight, QuantEmbedding):
        return weight[np.arange(weight.shape[0])].astype(np.float64)
    return np.asarray(weight, dtype=np.float64)


def float64_weights(model) -> dict:
    w = model.weights
    layers = [{name: as_float64(getattr(layer, name))
               for name in ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")} for layer in w.layers]
    return {"embedding": as_float64(w.embedding), "layers": layers,
            "output_norm": as_float64(w.output_norm), "output_t": as_float64(w.output_t)}


def prompts(vocab: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, vocab, size=int(rng.integers(2, 6))).tolist() for _ in range(count)]


def batched_and_single_logits(model, sequences, next_tokens):
    """One decode step of every sequence: together (one forward over their rows, `logit_rows`, the attend
    callback attending row by row over each sequence's own cache) and alone (one forward each)."""
    caches = {}
    for mode in ("batched", "single"):
        caches[mode] = []
        for tokens in sequences:
            cache = DenseAttention(model.config)
            model.forward(np.array(tokens), np.arange(len(tokens)), cache)
            caches[mode].append(cache)

    def attend(layer, q, k, v, positions):
        return np.concatenate([cache(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], positions[i:i + 1])
                               for i, cache in enumerate(caches["batched"])])

    positions = np.array([len(tokens) for tokens in sequences])
    batched = model.forward(np.array(next_tokens), positions, attend, logit_rows=np.arange(len(sequences)))
    single = np.stack([model.forward(np.array([token]), np.array([position]), cache)
                       for token, position, cache in zip(next_tokens, positions, caches["single"])])
    return batched, single


def relative_error(actual, expected):
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 5, 17])
def test_batched_forward_matches_single_sequences_and_float64_on_smollm2(smollm2, count):  # noqa: F811
    sequences = prompts(smollm2.config.vocab_size, count)
    next_tokens = [(7 * i + 11) % smollm2.config.vocab_size for i in range(count)]
    batched, single = batched_and_single_logits(smollm2, sequences, next_tokens)
    assert batched.shape == single.shape == (count, smollm2.config.vocab_size)
    weights64 = float64_weights(smollm2)
    for i, tokens in enumerate(sequences):
        exact = reference_logits(weights64, smollm2.config, tokens + [next_tokens[i]])
        assert relative_error(batched[i], exact) < 1e-5
        assert relative_error(single[i], exact) < 1e-5
        assert int(np.argmax(batched[i])) == int(np.argmax(single[i])) == int(np.argmax(exact))


def test_batched_forward_with_every_kernel_on_a_synthetic_model():
    """A plan forcing each blocked kernel in turn (blocks of 16 and 32 columns divide all its shapes)."""
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, seed=9)
    sequences = prompts(256, 6)
    next_tokens = list(range(6))
    weights64 = float64_weights(model)
    shapes = {w.shape for w in model.weights.matrices()}
    exact = [reference_logits(weights64, model.config, tokens + [token]) for tokens, token in zip(sequences, next_tokens)]
    for kernel in (Kernel(16, "xw"), Kernel(32, "wx"), GEMM):
        model.plan = MatmulPlan({shape: ((16, kernel),) for shape in shapes}) if kernel != GEMM else GEMM_ONLY
        batched, single = batched_and_single_logits(model, sequences, next_tokens)
        for i in range(len(sequences)):
            assert relative_error(batched[i], exact[i]) < 1e-5
            assert relative_error(single[i], exact[i]) < 1e-5


def test_kernel_bench_rows_have_the_ratios_it_prints():
    """The bench's shape only (speed is never asserted): a quick run on a small synthetic model."""
    from pagevis.bench.kernels import format_kernels, run_kernel_bench

    model = SyntheticModel(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, seed=1)
    result = run_kernel_bench(model, quick=True)
    rows = result["batched"]["rows"]
    assert [r["sequences"] for r in rows] == [1, 2, 4] and rows[0]["over_one"] == 1
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["sequences"] / r["step_ms"] * 1e3)
        assert r["of_floor"] == pytest.approx(result["batched"]["floor_ms"] / r["step_ms"])
    attention = result["attention"]
    assert attention["gb_s"] == pytest.approx(attention["kv_mb"] / attention["us"] * 1e3)
    assert attention["of_read"] == pytest.approx(attention["gb_s"] / attention["read_same_size_gb_s"])
    text = "\n".join(format_kernels(result))
    assert "not the engine's batch session" in text and "of the read bandwidth" in text


def test_a_plan_measured_under_load_is_measured_again_once_the_machine_is_quiet(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    matrices = [output_major(rng, 32, 192)]
    path = tmp_path / "plans.json"
    first = plan_for(matrices, path)
    info = first.measured[(32, 192)]
    assert set(info) == {"at", "others_busy"} and "measured" in first.describe()[0]
    stored = json.loads(path.read_text())
    (entry,) = next(iter(stored.values())).values()
    entry["others_busy"] = 0.9  # as if another process had held most of the CPUs while it was measured
    path.write_text(json.dumps(stored))
    calls = []
    real = matmul_module.calibrate
    monkeypatch.setattr(matmul_module, "calibrate", lambda samples: calls.append(set(samples)) or real(samples))
    monkeypatch.setattr(matmul_module, "others_busy_now", lambda: 0.9)
    busy = plan_for(matrices, path)  # still busy: the plan is kept, not measured under load again
    assert calls == [] and busy.under_load() == [(32, 192)] and "under load" in busy.describe()[0]
    monkeypatch.setattr(matmul_module, "others_busy_now", lambda: 0.0)

    monkeypatch.setattr(matmul_module, "CpuWatch", QuietWatch)
    quiet = plan_for(matrices, path)
    assert calls == [{(32, 192)}] and quiet.under_load() == []
    assert plan_for(matrices, path, remeasure=True) is not None and len(calls) == 2


@pytest.mark.slow
def test_the_cpu_watch_sees_other_processes():
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    children = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)
        with matmul_module.CpuWatch() as watch:
            time.sleep(0.6)
    finally:
        for child in children:
            child.wait()
    assert watch.share is not None and watch.share > 0.5

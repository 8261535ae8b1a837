"""Qwen 2, Qwen 3 and Llama 3 (with llama3 rope scaling) GGUF layouts: tiny random-weight files written by
scripts/make_tiny_model_reference.py, whose logits and tokenizer ids transformers computed (its own GGUF loader,
float32, eager attention). pagevis loads the same files and must give the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagevis.model import DenseAttention, load_model

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "tiny_models_reference.json").read_text())["models"]


@pytest.fixture(scope="module", params=sorted(REFERENCE))
def loaded(request):
    case = REFERENCE[request.param]
    return request.param, load_model(DATA / case["file"]), case


def test_logits_equal_transformers(loaded):
    name, model, case = loaded
    ids = np.array(case["ids"])
    logits = model.forward(ids, np.arange(len(ids)), DenseAttention(model.config), all_logits=True)
    np.testing.assert_allclose(logits[case["rows"]], np.array(case["logits"]), rtol=1e-4, atol=2e-4)


def test_architecture_reads_as_its_layout(loaded):
    name, model, _ = loaded
    layout = model.config.layout
    assert model.config.architecture == {"qwen2": "qwen2", "qwen3": "qwen3", "llama3": "llama"}[name]
    assert (layout.rope_neox, layout.qkv_bias, layout.qk_norm) == {
        "qwen2": (True, True, False), "qwen3": (True, False, True), "llama3": (False, False, False)}[name]
    if name == "qwen3":  # head_dim from attention.key_length, not d_model / n_heads
        assert (model.config.d_model, model.config.n_heads, model.config.head_dim) == (32, 4, 16)
    assert bool(model.config.rope_factors) == (name == "llama3")


def test_llama3_rope_scaling_matters(loaded):
    """Without the rope_freqs factors the late positions come out different: the reference pins the scaling."""
    name, model, case = loaded
    if name != "llama3":
        pytest.skip("only the Llama 3 file carries rope_freqs")
    from dataclasses import replace

    from pagevis.model.decoder import DecoderModel

    plain = replace(model.config, rope_factors=())
    ids = np.array(case["ids"])
    logits = DecoderModel(plain, model.weights, None).forward(ids, np.arange(len(ids)), DenseAttention(plain),
                                                           all_logits=True)
    assert np.abs(logits[case["rows"]][-1] - np.array(case["logits"][-1])).max() > 1e-2


def test_tokenizer_ids_equal_transformers(loaded):
    name, model, case = loaded
    for string in case["strings"]:
        assert model.tokenizer.encode(string["text"]) == string["ids"], (name, string["text"])
        assert model.tokenizer.decode(string["ids"], skip_special=True) == string["text"]

"""Gemma 3 270M (the pagevis[gemma] extra) against transformers: tokenizer ids on a hard string set and greedy
decoding, float32, on the same GGUF (tests/data/gemma3_reference.json, made by scripts/make_gemma_reference.py).
The 1000-token prompt is only reproduced with the 512-token window on the local layers.

Skipped when the gemma packages are not installed (`make gemma`); loading the model takes tens of seconds, so the
tests that need it are marked slow."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from pagevis.model import DenseAttention, DecoderModel, load_model, set_blas_threads
from pagevis.model.locate import GEMMA_PACKAGE, gemma3_270m_path

REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_reference.json").read_text())
pytestmark = pytest.mark.skipif(importlib.util.find_spec(GEMMA_PACKAGE) is None,
                                reason="Gemma 3 270M is not installed (make gemma)")


@lru_cache(maxsize=1)
def gemma() -> DecoderModel:
    set_blas_threads(1)
    return load_model(gemma3_270m_path())


def greedy(model: DecoderModel, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    attend = DenseAttention(model.config)
    logits = model.forward(np.array(ids), np.arange(len(ids)), attend)
    first, out = logits, []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = model.forward(np.array(out[-1:]), np.array([len(ids) + len(out) - 1]), attend)
    return out, first


def test_the_file_is_found_and_checked_once():
    path = gemma3_270m_path()
    assert path.name == REFERENCE["source"] and path.stat().st_size > 200 << 20
    assert gemma3_270m_path() == path  # the stamp: no second join


def test_parts_from_another_install_keep_the_joined_file_when_it_matches(tmp_path):
    path = gemma3_270m_path(cache=tmp_path)
    stamp = path.with_suffix(".stamp.json")
    elsewhere = stamp.read_text().replace('"/', '"/another/venv/')
    stamp.write_text(elsewhere)
    joined_at = path.stat().st_mtime_ns
    assert gemma3_270m_path(cache=tmp_path) == path
    assert path.stat().st_mtime_ns == joined_at  # hashed, found equal, kept: caches keyed on it stay valid
    assert stamp.read_text() != elsewhere
    with path.open("r+b") as file:  # the same size but other bytes: joined again
        file.seek(1 << 20)
        file.write(b"\xff" * 16)
    stamp.write_text(elsewhere)
    assert gemma3_270m_path(cache=tmp_path) == path
    assert path.stat().st_mtime_ns != joined_at
    with path.open("rb") as file:
        file.seek(1 << 20)
        assert file.read(16) != b"\xff" * 16


@pytest.mark.slow
def test_config_has_the_sliding_window_pattern():
    c = gemma().config
    assert c.architecture == "gemma3" and c.n_layers == 18
    assert c.sliding_windows == tuple(None if i % 6 == 5 else 512 for i in range(18))
    assert c.rope_bases == tuple(1e6 if i % 6 == 5 else 1e4 for i in range(18))
    weights = gemma().weights
    assert weights.embedding.shape == (262144, 640)
    assert weights.embedding.matrix is weights.output_t  # tied: one packed Q8_0 matrix
    assert gemma().weight_info["types"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}


@pytest.mark.slow
def test_tokenizer_equals_transformers():
    tokenizer = gemma().tokenizer
    for case in REFERENCE["strings"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.decode(case["ids"], skip_special=True) == case["text"]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(REFERENCE["prompts"])))
def test_greedy_decoding_equals_transformers(index):
    case = REFERENCE["prompts"][index]
    out, first = greedy(gemma(), case["ids"], len(case["greedy"]))
    assert out == case["greedy"]
    np.testing.assert_allclose(first[case["top_ids"]], case["top_logits"], atol=5e-2)


@pytest.mark.slow
def test_the_long_prompt_needs_the_window():
    """Full attention on every layer (no window) answers the 1000-token prompt differently."""
    model = gemma()
    case = max(REFERENCE["prompts"], key=lambda c: len(c["ids"]))
    assert len(case["ids"]) > 900
    full = replace(model.config, sliding_windows=(None,) * model.config.n_layers)
    logits = DecoderModel(full, model.weights, None).forward(np.array(case["ids"]), np.arange(len(case["ids"])),
                                                          DenseAttention(full))
    assert np.abs(logits[case["top_ids"]] - np.array(case["top_logits"])).max() > 0.5


@pytest.mark.slow
def test_the_paged_engine_decodes_gemma_like_transformers():
    """Below the 512-token window the paged cache (which keeps every token) must give transformers' answer too:
    head_dim 256, one KV head, the query scale and the per-layer RoPE bases all reach the engine's attention."""
    from pagevis.engine import DecodeSession, SessionConfig

    case = REFERENCE["prompts"][0]
    model = gemma()
    session = DecodeSession(model, model.tokenizer.decode(case["ids"], skip_special=True),
                            SessionConfig(page_size=8, max_pages=64, policy="none", chat=False,
                                          max_new_tokens=len(case["greedy"])))
    assert list(session.prompt_ids) == case["ids"]
    list(session.run())
    assert session.generated == case["greedy"]

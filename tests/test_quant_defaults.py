"""int4 at the app's default cache quantizes tokens: KIVI's residual window (128 tokens) is clamped to the
budget, so perplexity moves off float32's and the bytes per token fall below float16's; the clamp is
reported wherever the storage is (run --json's summary, compare's rows, the status bar's text)."""

import pytest
from model_fixtures import smollm2  # noqa: F401  (fixture)
from quant_reference import clamped_residual

from pagevis.quality import measure
from pagevis.engine import SessionConfig
from pagevis.kvcache import CacheConfig
from pagevis.kvcache.quant import storage_summary, storage_text

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering "
        "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters. My dear Mr. Bennet, said "
        "his lady to him one day, have you heard that Netherfield Park is let at last? Mr. Bennet replied that "
        "he had not. But it is, returned she; for Mrs. Long has just been here, and she told me all about it.")


def smollm2_config(**settings) -> CacheConfig:
    return CacheConfig(**settings, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)


def test_the_app_defaults_clamp_the_window_below_float16():
    app = SessionConfig()
    assert (app.capacity, app.residual) == (96, 128)  # what the clamp is for: KIVI's 128 > the whole budget
    config = smollm2_config(**{**app.cache_settings(), "dtype": "int4"})
    summary = storage_summary(config)
    assert summary["residual"] == clamped_residual("int4", 128, 96, 3, 64) == 1
    assert summary["residual_requested"] == 128
    float16 = smollm2_config(**{**app.cache_settings(), "dtype": "float16"}).kv_bytes_per_token()
    assert summary["kv_bytes_per_token"] < float16 == 30 * 768
    assert "residual 128 clamped to 1" in summary["storage_notice"] in storage_text(config)


@pytest.mark.parametrize("dtype,budget,residual", [("int4", 256, 128), ("int2", 128, 128), ("int4", 512, 128),
                                                   ("int4", 64, 0), ("int4", 96, 5)])
def test_the_clamp_equals_a_hand_count(dtype, budget, residual):
    config = smollm2_config(page_size=16, max_pages=budget // 16, dtype=dtype, residual=residual)
    expected = clamped_residual(dtype, residual, budget, 3, 64)
    summary = storage_summary(config)
    assert summary["residual"] == expected
    assert ("residual_requested" in summary) == (expected != residual)
    if expected:  # (the reference's count: the largest residual within float16's bytes)
        assert summary["kv_bytes_per_token"] <= 30 * 768


def test_a_cache_costlier_than_float32_says_why():
    """32 tokens: a key group of 32 waits in float32 before it is quantized, so int4 costs more than float32."""
    config = smollm2_config(page_size=8, max_pages=4, dtype="int4", residual=0)
    summary = storage_summary(config)
    assert summary["kv_bytes_per_token"] > 30 * 1536
    assert "more than float32's 1536" in summary["storage_notice"]
    assert "storage_notice" not in storage_summary(smollm2_config(page_size=8, max_pages=64, dtype="int4",
                                                                  residual=0))


@pytest.mark.slow
def test_int4_at_the_app_defaults_changes_perplexity(smollm2):
    """Teacher-forced through the app's default cache (96 tokens, residual 128 asked): int4's perplexity
    differs from float32's (it used to equal it to every digit: nothing was quantized) and its row reports
    the clamped residual and fewer bytes per token than float16."""
    app = SessionConfig()
    ids = smollm2.tokenizer.encode(TEXT)[:112]
    assert len(ids) == 112
    with measure.full_reference(smollm2, ids, page_size=app.page_size) as reference:
        rows = {dtype: measure.evaluate(smollm2, reference, measure.PolicyChoice(app.policy), app.capacity,
                                        app.page_size, dtype, residual=app.residual) for dtype in ("float32", "int4")}
    assert rows["int4"].ppl != pytest.approx(rows["float32"].ppl, rel=1e-4)
    assert rows["int4"].residual == 1 and "clamped to 1" in rows["int4"].storage_notice
    assert rows["int4"].kv_bytes_per_token < 30 * 768 < rows["float32"].kv_bytes_per_token


def test_the_status_bar_says_the_window_was_clamped(qtbot, tmp_path):
    pytest.importorskip("pytestqt")
    from gui_helpers import SYNTH, make_window

    config = SessionConfig(dtype="int4", max_new_tokens=4, chat=False)  # the app's cache, int4, residual 128 asked
    window = make_window(qtbot, tmp_path, spec=SYNTH, prompt="a clamped window", config=config)
    # synthetic layout (2 KV heads x 16): even residual 0 costs more than float16 in 96 tokens, so 0
    assert "residual 128 clamped to 0" in window.status_memory.text()
    assert "the fewest it can" in window.status_memory.toolTip()

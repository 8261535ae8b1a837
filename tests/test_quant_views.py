"""Quantized storage as the records, traces, the app's spill file and the app show it: which slots are
still in full precision (int4 / int2), the storage and its bits per token in the status bar."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
from pagevis.kvcache.quant import storage_text
from pagevis.trace import read_trace, record_differences, write_trace

SPEC = ModelSpec(kind="synthetic", n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, seed=2)


def quantized_session(steps=60, **overrides):
    # 144 tokens: the smallest multiple of 4 at which this layout keeps residual 5 (at 64 the window is clamped)
    config = dict(page_size=4, max_pages=36, policy="sinks", dtype="int4", residual=5, max_new_tokens=200,
                  chat=False)
    config.update(overrides)
    session = DecodeSession(SPEC.load(), "a quantized cache, token by token", SessionConfig(**config))
    for _ in range(steps):
        session.step()
    return session


def test_records_mark_the_slots_still_in_full_precision():
    session = quantized_session()
    record, store = session.records[-1], session.cache.stores[1]
    held = record.slot_maps[1] >= 0
    expected = (store.res_of[np.arange(store.n_slots)] >= 0).reshape(record.slot_maps[1].shape) & held
    np.testing.assert_array_equal(record.full_precision[1], expected)
    # the newest tokens are the ones in float32: between residual and residual + 31 of them (plus the new one)
    in_window = np.sort(record.slot_maps[1][record.full_precision[1]])
    resident = np.sort(record.slot_maps[1][held])
    assert 5 <= len(in_window) <= 5 + 31 + 1 and np.array_equal(in_window, resident[-len(in_window):])
    assert not record.full_precision[1][~held].any()
    assert quantized_session(steps=3, dtype="int8").records[-1].full_precision is None
    assert quantized_session(steps=3, dtype="float16").records[-1].full_precision is None


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_a_quantized_run_round_trips_through_a_trace(dtype, tmp_path):
    session = quantized_session(steps=50, dtype=dtype, oracle=True)
    write_trace(tmp_path / "q.pvtrace", session, model_spec=SPEC)
    loaded = read_trace(tmp_path / "q.pvtrace")
    assert loaded.config == session.config and loaded.config.residual == 5
    assert [record_differences(a, b) for a, b in zip(session.records, loaded.records)] == [[]] * 50
    assert (loaded.records[-1].full_precision is None) == (dtype == "int8")


@pytest.mark.parametrize("pages,page_size", [(16, 4), (1, 2)])  # (1, 2): 6 flags, packed into one byte
def test_the_spill_file_keeps_the_full_precision_flags(pages, page_size):
    from pagevis.viewmodel.spill import RecordSpill

    session = quantized_session(steps=45, max_pages=pages, page_size=page_size, residual=0,
                                policy="oldest" if pages * page_size < 8 else "sinks")
    spill = RecordSpill()
    for record in session.records:
        spill.append(record)
    for index in (0, 20, 44):
        back = spill.record(index, session.token_text)
        original = session.records[index]
        np.testing.assert_array_equal(back.protected, original.protected)
        np.testing.assert_array_equal(back.full_precision, original.full_precision)
    plain = quantized_session(steps=3, dtype="float32")
    spill.close()
    spill = RecordSpill()
    spill.append(plain.records[-1])
    assert spill.record(0, plain.token_text).full_precision is None
    spill.close()


def test_storage_text_says_the_bits_and_the_window():
    config = quantized_session(steps=1).cache_config
    text = storage_text(config)
    assert text.startswith("int4: ") and "bits per K/V value" in text and "newest 5 + up to 31 tokens" in text
    bits = 8 * config.kv_bytes_per_token() / (2 * 3 * 2 * 8)
    assert f"{bits:.2f} bits" in text


# --- the app -----------------------------------------------------------------------------------------------

def test_the_app_shows_a_quantized_cache(qtbot, tmp_path):
    pytest.importorskip("pytestqt")
    from gui_helpers import SYNTH, make_window, step

    from pagevis.gui.session.rendering import memory_text
    from pagevis.gui.widgets.page_grid import FULL_PRECISION_COLOR, cell_image

    config = SessionConfig(page_size=4, max_pages=16, policy="sinks", dtype="int4", residual=4, max_new_tokens=80,
                           chat=False)
    window = make_window(qtbot, tmp_path, spec=SYNTH, prompt="a quantized page grid, on screen", config=config)
    assert window.controls.dtype.currentData() == "int4" and window.controls.residual.value() == 4
    assert window.controls.residual.isEnabled()
    step(qtbot, window, 20)
    grid = window.page_grid
    record = window.timeline.records[-1]
    full = record.full_precision[0]
    assert grid.full_precision is not None and np.array_equal(grid.full_precision, full)
    assert 4 <= full.sum() < (record.slot_maps[0] >= 0).sum(), "some slots quantized, the newest in float32"
    assert grid.precision_legend.isVisible()
    page, slot = np.argwhere(full)[0]
    assert "in float32" in grid.cell_info(page, slot)
    page, slot = np.argwhere(~full & (record.slot_maps[0] >= 0))[0]
    assert "quantized (int4)" in grid.cell_info(page, slot)
    # full-precision cells carry the bar; the image differs exactly in those cells
    plain = cell_image(grid.states, grid.shade, True)
    marked = cell_image(grid.states, grid.shade, True, full)
    changed = np.any(marked != plain, axis=-1).reshape(full.shape[0], 12, full.shape[1], 12).any(axis=(1, 3))
    np.testing.assert_array_equal(changed, full)
    bar = [int(FULL_PRECISION_COLOR[i:i + 2], 16) for i in (1, 3, 5)]
    for (p, q), in_window in ((np.argwhere(full)[0], True), ((page, slot), False)):
        pixel = marked[p * 12 + 9, q * 12 + 5, :3].astype(int)
        assert (np.abs(pixel - bar).max() <= 1) == in_window
    info = window.timeline.info
    assert info.kv_bytes_per_token == pytest.approx(window.runner.session.cache_config.kv_bytes_per_token())
    text = window.status_memory.text()
    assert text == memory_text(info.cache_bytes, info.n_kv_heads, "int4", info.kv_bytes_per_token,
                               info.storage_notice)
    assert text.endswith(" · residual 4 clamped to 0")  # 64 tokens of this layout: the window is clamped
    assert f"int4, {8 * info.kv_bytes_per_token / 1000:,.1f} kbit per token" in text
    assert "bits per K/V value" in window.status_memory.toolTip()

    window.controls.dtype.setCurrentIndex(window.controls.dtype.findData("int8"))
    assert not window.controls.residual.isEnabled()
    assert window.controls.session_config().dtype == "int8"


# --- the server and the metrics --------------------------------------------------------------------------------

def test_metrics_count_the_kv_bytes_of_live_caches():
    from prometheus_client import generate_latest
    from test_serve_load import scrape, value

    from pagevis.observe import Metrics

    metrics = Metrics()
    sessions = [quantized_session(steps=2, dtype=dtype) for dtype in ("int4", "float16")]
    observers = [metrics.observe(s) for s in sessions]
    samples = scrape(generate_latest(metrics.registry).decode())
    total = sum(s.cache_config.kv_bytes_per_token() * s.cache_config.capacity for s in sessions)
    assert value(samples, "pagevis_kv_cache_bytes") == pytest.approx(total)
    assert value(samples, "pagevis_kv_cache_bytes_per_token") == pytest.approx(
        total / sum(s.cache_config.capacity for s in sessions))
    observers[0].close()
    samples = scrape(generate_latest(metrics.registry).decode())
    assert value(samples, "pagevis_kv_cache_bytes_per_token") == pytest.approx(
        sessions[1].cache_config.kv_bytes_per_token())


def test_the_server_takes_the_dtype_and_residual_and_describes_the_storage():
    from serve_fixtures import running_server

    with running_server() as server:
        answer = server.client.post("/v1/sessions", json={"prompt": "x", "dtype": "int4", "residual": 16,
                                                          "max_tokens": 4})
        assert answer.status_code == 201, answer.text
        body = answer.json()
        assert body["config"]["dtype"] == "int4" and body["config"]["residual"] == 16
        storage = body["storage"]
        # the window as used: clamped to the session's budget, the residual asked beside it when it was
        assert storage["dtype"] == "int4" and storage.get("residual_requested", storage["residual"]) == 16
        assert storage["residual"] <= 16 and ("residual_requested" in storage) == ("storage_notice" in storage)
        assert storage["kv_bytes_per_token"] > storage["kv_quantized_bytes_per_token"] > 0
        refused = server.client.post("/v1/sessions", json={"prompt": "x", "dtype": "int4", "residual": -1})
        assert refused.status_code == 422 and "residual" in refused.text


# --- the bench -----------------------------------------------------------------------------------------------

def test_bench_rows_give_exact_bytes_and_the_error_of_each_storage():
    from pagevis.bench.suite import quantized_rows

    rows = {r["dtype"]: r for r in quantized_rows([300], page_size=16, residual=32, repeats=2)}
    # SmolLM2's layer (3 KV heads, head dim 64), 300 tokens in 19 pages of 16 = 304 slots. int4 / int2: each
    # slot's codes, V scales and zero points (96 + 96 + 24 or 48 + 48 + 24 bytes) and key-group index (4), a
    # key group (3 x 64 x 2 x 2 bytes) per 32 slots, rounded up (10), and 32 + 31 float32 window tokens (1536)
    side = 10 * 768 + 63 * 1536
    per_layer = {"float32": 1536, "float16": 768, "int8": 396,
                 "int4": (304 * (96 + 96 + 24 + 4) + side) / 304, "int2": (304 * (48 + 48 + 24 + 4) + side) / 304}
    for dtype, expected in per_layer.items():
        assert rows[dtype]["kv_bytes_per_token"] == pytest.approx(expected)
        assert rows[dtype]["kv_bytes"] == round(expected * 304)
    assert rows["float32"]["rel_error"] == 0 and rows["float16"]["rel_error"] < 1e-3
    assert rows["float16"]["rel_error"] < rows["int8"]["rel_error"] < rows["int4"]["rel_error"] < \
        rows["int2"]["rel_error"] < 1  # random normal K/V: 2 bits leave little
    assert rows["int8"]["rel_error"] < 0.01

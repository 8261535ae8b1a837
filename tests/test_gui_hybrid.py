"""The app on a hybrid cache (a synthetic model with a sliding window on layer 0, layer 1 global), driven for
real offscreen: the layer box and the grid say each layer's type, slid-out pages are drawn as such, the events
list the slides, the status bar gives the bytes by layer type."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytestqt")
from gui_helpers import PROMPT, make_window, step  # noqa: E402

from pagevis.engine import ModelSpec, SessionConfig  # noqa: E402
from pagevis.viewmodel.cells import SLID, WRITTEN  # noqa: E402

W, PS = 8, 4
SPEC = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1, sliding_window=W,
                 global_every=2)
CONFIG = SessionConfig(page_size=PS, max_pages=16, policy="none", max_new_tokens=40, chat=False)


def test_a_local_layer_slides_its_window_and_every_view_says_so(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    step(qtbot, window)  # the 17-token prompt: positions 9..16 stay in layer 0's window, pages 0 and 1 slide out
    grid, controls = window.page_grid, window.controls
    assert controls.layer.value() == 0 and controls.layer.suffix() == f"  (local W={W})"
    assert "slid&nbsp;out&nbsp;of&nbsp;the&nbsp;window" in grid.legend.text()
    assert (grid.states[:2] == SLID).all() and (grid.states[2:4] == WRITTEN).all()
    assert [row[:3] for row in grid.blocks.rows] == [(2, 2, 4), (3, 3, 4), (4, 4, 1)]  # logical pages 2..4
    rows = window.events.visible_rows()
    assert [(r[1], r[2], r[4], r[6]) for r in rows] == [(0, 0, 3, f"slid out of the window ({W})"),
                                                        (0, 1, 7, f"slid out of the window ({W})")]
    page_bytes = 2 * PS * 2 * 16 * 4
    assert page_bytes == 1024
    # 3 local pages + 5 global ones, against 2 x 5 without a window
    assert window.status_memory.text() == "hybrid K/V 8 KiB (1 local 3 + 1 global 5) vs 10 KiB without windows"
    assert "pages 0–1 slid out of the window" in window.narration.text()

    step(qtbot, window, 12)
    record = window.timeline.records[-1]
    assert len(record.block_tables[0]) <= -(-(W + PS) // PS) and len(record.block_tables[1]) == -(-29 // PS)
    resident = record.slot_maps[0][record.slot_maps[0] >= 0]
    assert resident.min() >= 29 - 1 - W + 1 - (PS - 1) and resident.max() == 28

    controls.layer.setValue(1)
    window.redraw()
    assert controls.layer.suffix() == "  (global)"
    assert "layer 1 (global)" in grid.plot.titleLabel.text
    assert not (grid.states == SLID).any() and np.sum(grid.states != 0) == 29


def test_the_timeline_counts_a_local_layers_tokens_without_the_slid_out_ones(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    step(qtbot, window, 10)
    records = window.timeline.records
    for layer in range(2):
        expected = [int((r.slot_maps[layer] >= 0).sum()) for r in records]
        assert window.timeline.resident_per_step(layer).tolist() == expected
    assert max(window.timeline.resident_per_step(0)) <= W + PS < window.timeline.resident_per_step(1)[-1]


def test_a_trace_of_a_hybrid_run_replays_with_its_layer_types_and_slides(tmp_path):
    from pagevis.engine import DecodeSession
    from pagevis.trace import read_trace, write_trace
    from pagevis.viewmodel.timeline import timeline_from_trace

    session = DecodeSession(SPEC.load(), PROMPT, CONFIG)
    for _ in range(6):
        session.step()
    path = tmp_path / "hybrid.pvtrace"
    write_trace(path, session, model_spec=SPEC)
    timeline = timeline_from_trace(read_trace(path))
    assert timeline.info.sliding_windows == (W, None)
    # 17 prompt tokens and 5 more: the query at 21 sees 14..21, so pages 0-2 (positions 0-11) have slid out
    assert [(e.page, e.reason) for e in timeline.evictions] == [(p, f"slid out of the window ({W})") for p in range(3)]
    assert timeline.resident_per_step(0).tolist() == [int((r.slot_maps[0] >= 0).sum()) for r in session.records]


def test_the_sequences_window_gives_the_hybrid_pools_bytes_by_layer_type(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    seqs = window.open_sequences()
    qtbot.addWidget(seqs)
    seqs.start()
    for _ in range(12):
        seqs.step()
        qtbot.waitUntil(lambda: not seqs.busy, timeout=120_000)
    record = seqs.view.record
    local, global_ = record.hybrid.local, record.hybrid.global_
    assert 0 < local < global_  # layer 0's window let pages go that layer 1 keeps
    assert seqs.view.memory_note.text().endswith(f"\nAll layers: {record.hybrid.text()}.")
    seqs.close()


@pytest.mark.slow
def test_the_server_window_gives_the_hybrid_pools_bytes_by_layer_type(qtbot, tmp_path):
    from dataclasses import replace

    from pagevis.presets import SERVER_PRESETS

    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    first = SERVER_PRESETS[0]
    server = window.open_server(replace(first, server=replace(first.server, step_seconds=None)))
    qtbot.addWidget(server)
    qtbot.waitUntil(lambda: "without windows" in server.status.text(), timeout=30000)
    assert "A: " in server.status.text() and ", hybrid K/V " in server.status.text()
    server.close()


def test_leaving_a_hybrid_model_takes_slid_out_off_the_legend_at_once(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    step(qtbot, window)
    assert "slid&nbsp;out" in window.page_grid.legend.text()
    window.controls.set_configuration(spec=ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2,
                                                     head_dim=16, seed=1))  # the same model without windows
    window.restart("model changed", blocking=True)
    window.redraw()
    assert window.timeline is not None and not len(window.timeline)  # before its first step
    assert "slid&nbsp;out" not in window.page_grid.legend.text()


def test_the_slides_reasons_fit_the_events_table_at_1280_x_720(qtbot, tmp_path):
    from clipping import clipped_texts

    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    window.resize(1280, 720)
    window.size_docks()
    step(qtbot, window)
    qtbot.wait(30)
    assert any("slid out of the window" in row[6] for row in window.events.visible_rows())
    assert [c for c in clipped_texts(window.events) if "EventsView" in c or "QTableView" in c] == []


def test_a_page_that_slid_out_keeps_its_colour_until_the_pool_hands_it_out_again(qtbot, tmp_path):
    """Gemma's grid showed no slid-out colour: a page slides once every page-size steps and was coloured for that
    one step only. It stays brown while it holds nothing; a page the pool reuses is drawn as what it holds."""
    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    step(qtbot, window, 3)  # the prompt's pages 0 and 1 slid out two steps ago
    grid = window.page_grid
    record = window.timeline.records[-1]
    free = [p for p in range(CONFIG.max_pages) if p not in record.block_tables[0]
            and (record.slot_maps[0][p] < 0).all()]
    slid = [p for p in range(CONFIG.max_pages) if (grid.states[p] == SLID).all()]
    assert {0, 1} <= set(slid) and set(slid) <= set(free)
    window.controls.layer.setValue(1)  # a global layer: nothing slides
    window.redraw()
    assert not (grid.states == SLID).any()


def test_the_metrics_csv_gives_each_kind_of_layer_its_resident_tokens(qtbot, tmp_path):
    """File > Export of the metrics: beside layer 0's resident tokens (a local layer's here), one column per kind of
    layer with the most tokens one of its layers holds after each step (counted from the records' slot maps)."""
    import csv

    from pagevis.gui.widgets.export import save_metrics_csv

    window = make_window(qtbot, tmp_path, SPEC, PROMPT, CONFIG)
    step(qtbot, window, 6)
    path = tmp_path / "metrics.csv"
    assert save_metrics_csv(window.timeline, str(path)) == 6
    rows = list(csv.DictReader(path.open()))
    for row, record in zip(rows, window.timeline.records, strict=True):
        held = [int((record.slot_maps[layer] >= 0).sum()) for layer in range(2)]
        assert int(row["resident_tokens"]) == record.resident_tokens == held[0]
        assert (int(row[f"resident_tokens local W={W}"]), int(row["resident_tokens global"])) == tuple(held)
    assert int(rows[-1]["resident_tokens global"]) > int(rows[-1][f"resident_tokens local W={W}"])

"""Replaying a trace in the app shows the same page grid, step by step, as the live session did."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QSettings  # noqa: E402

from pagevis.engine import ModelSpec, SessionConfig  # noqa: E402

SYNTH = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=4)
CONFIG = SessionConfig(page_size=4, max_pages=3, policy="h2o", max_new_tokens=12, chat=False)


@pytest.fixture
def window(qtbot, tmp_path, qapp):
    from pagevis.gui.session.window import MainWindow

    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    window = MainWindow(settings=QSettings(str(tmp_path / "gui.ini"), QSettings.IniFormat), restore=False)
    qtbot.addWidget(window)
    window.apply_arguments(SYNTH, "pages, evicted", CONFIG)
    window.resize(1200, 800)
    window.show()
    window.start()
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=120_000)
    return window


def grids(window, layers):
    """Per step and layer: the page grid's cell states, its cell labels and its block table rows."""
    shown = []
    for index in range(len(window.timeline)):
        window.scrub(index)
        for layer in layers:
            window.controls.layer.setValue(layer)
            window.redraw()
            grid = window.page_grid
            shown.append((index, layer, grid.states.copy(), list(grid.blocks.rows)))
    return shown


def test_replay_shows_the_live_page_grid(qtbot, window, tmp_path):
    for _ in range(14):
        count = len(window.timeline)
        window.step()
        qtbot.waitUntil(lambda: not window.runner.busy and len(window.timeline) == count + 1, timeout=10000)
    assert sum(len(r.evictions) for r in window.timeline.records) > 0
    live = grids(window, layers=(0, 1))

    path = tmp_path / "live.pvtrace"
    assert window.files.save_trace(str(path)) == str(path)  # File ▸ Save trace: the timeline's records
    steps = len(window.timeline)
    assert window.open_trace(str(path)) and window.runner.state == "replay"
    replayed = grids(window, layers=(0, 1))

    assert len(replayed) == len(live) == 2 * steps
    for (index, layer, states, rows), (_, _, states_again, rows_again) in zip(live, replayed):
        np.testing.assert_array_equal(states, states_again, err_msg=f"step {index} layer {layer}")
        assert rows == rows_again, f"step {index} layer {layer}"

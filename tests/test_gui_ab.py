"""The A/B window driven for real (offscreen, synthetic model): Space plays whatever has the focus, a preset
plays by itself, and nothing shows pyqtgraph's default axes while the model loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402

from gui_helpers import CONFIG, PROMPT, SYNTH, make_window  # noqa: E402

from pagevis.gui.widgets.theme import FREE  # noqa: E402


def open_ab(qtbot, window, play=False):
    ab = window.open_ab(CONFIG, replace(CONFIG, policy="oldest"), PROMPT, play=play)
    qtbot.addWidget(ab)
    return ab


def press_space_in(qtbot, widget) -> None:
    widget.window().activateWindow()
    widget.setFocus()
    qtbot.waitUntil(lambda: widget.hasFocus(), timeout=3000)
    qtbot.keyClick(widget, Qt.Key_Space)


def test_space_plays_and_pauses_the_ab_window_while_the_layer_box_has_the_focus(qtbot, window):
    ab = open_ab(qtbot, window)
    qtbot.waitUntil(lambda: ab.runner.state == "ready", timeout=10000)
    assert not len(ab.timeline)
    press_space_in(qtbot, ab.layer)
    qtbot.waitUntil(lambda: len(ab.timeline) >= 3, timeout=10000)  # playing: both sides decode
    press_space_in(qtbot, ab.sides[0][0].page_size)  # a side's spin box: Space pauses
    qtbot.waitUntil(lambda: not ab.runner.busy, timeout=10000)
    count = len(ab.timeline)
    qtbot.wait(100)
    assert len(ab.timeline) == count and ab.layer.value() == 0 and ab.sides[0][0].page_size.value() == 4


def test_space_in_a_main_window_spin_box_plays_too(qtbot, window):
    press_space_in(qtbot, window.controls.page_size)
    qtbot.waitUntil(lambda: len(window.timeline) >= 3, timeout=10000)
    window.toggle_play()
    qtbot.waitUntil(lambda: not window.runner.busy, timeout=10000)
    assert window.runner.session.config.page_size == CONFIG.page_size  # Space typed nothing into the box


def test_an_ab_preset_plays_by_itself(qtbot, tmp_path):
    from pagevis.presets import find_preset

    window = make_window(qtbot, tmp_path)
    preset = find_preset("streaming")
    window.controls.presets.activated.emit(window.controls.presets.findData(preset))
    ab = window.ab_window
    qtbot.addWidget(ab)
    qtbot.waitUntil(lambda: ab.timeline is not None and len(ab.timeline) >= 3, timeout=20000)
    ab.toggle_play()
    qtbot.waitUntil(lambda: not ab.runner.busy, timeout=10000)


def test_while_the_model_loads_each_grid_shows_its_empty_pool(qtbot, tmp_path):
    from pagevis.gui.ab.window import ABWindow

    b = replace(CONFIG, page_size=8, max_pages=3)
    ab = ABWindow(SYNTH, PROMPT, CONFIG, b)  # not started: no timeline yet
    qtbot.addWidget(ab)
    ab.show()
    for (_, grid, _), config in zip(ab.sides, (CONFIG, b)):
        assert grid.states.shape == (config.max_pages, config.page_size) and (grid.states == FREE).all()
        (x0, x1), (y0, y1) = grid.plot.viewRange()
        assert -1 < x0 < 0.5 and config.page_size <= x1 < config.page_size + 1
        assert -1 < y0 < 0.5 and config.max_pages <= y1 < config.max_pages + 1
        assert f"{config.max_pages} pages × {config.page_size} slots" in grid.plot.titleLabel.text
    (x0, x1), (y0, y1) = ab.plot.viewRange()
    assert x0 > -0.5 and y0 > -0.5 and x1 <= 2 and y1 <= 2  # the KL plot starts at 0, not at −400

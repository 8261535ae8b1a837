"""The A/B window driven for real (offscreen, synthetic model): Space plays whatever has the focus, a preset
plays by itself, and nothing shows pyqtgraph's default axes while the model loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402

from gui_helpers import CONFIG, PROMPT, SYNTH, make_window  # noqa: E402

from pagevis.viewmodel.cells import FREE  # noqa: E402


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
    qtbot.waitUntil(lambda: ab.timeline is not None and len(ab.timeline) >= 3, timeout=120_000)
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
    (x0, x1), (y0, y1) = ab.plots.left.viewRange()
    assert x0 > -0.5 and y0 > -0.5 and x1 <= 2 and y1 <= 2  # the KL plot starts at 0, not at −400


def test_left_in_a_freshly_opened_ab_window_moves_a_step_back(qtbot, window):
    """Opening the A/B left the focus in the layer box, which ate ← and → (they moved its text cursor)."""
    from PySide6.QtWidgets import QApplication

    ab = open_ab(qtbot, window)
    qtbot.waitUntil(lambda: ab.runner.state == "ready", timeout=10000)
    ab.runner.step_blocking(3)
    ab.activateWindow()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is not None, timeout=3000)
    assert ab.index == 2 and not isinstance(QApplication.focusWidget(), type(ab.layer))
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key_Left)
    assert ab.index == 1
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key_Right)
    assert ab.index == 2


def test_same_text_reads_one_text_on_both_sides_with_the_full_cache_and_compares_numbers(qtbot, tmp_path, capsys):
    """The "same text" mode: one token a step after the warm-up, each side's running perplexity and the full
    cache's — the numbers `pagevis run --teacher-forced` (and so `pagevis compare`) gives for the same tokens."""
    import json
    from pathlib import Path

    from pagevis.cli.main import main
    from pagevis.gui.ab.window import ABWindow
    from pagevis.viewmodel.ab_session import WARM_UP_MARGIN

    a, b = replace(CONFIG, policy="oldest", page_size=8, max_pages=4), replace(CONFIG, page_size=8, max_pages=4)
    text = Path(__file__).parent.parent / "resources" / "texts" / "pride-and-prejudice-ch1.txt"
    ab = ABWindow(SYNTH, PROMPT, a, b, text=str(text))
    qtbot.addWidget(ab)
    ab.show()
    ab.start(blocking=True)
    assert ab.same_text.isChecked() and ab.timeline.forced
    ab.runner.step_blocking(40)
    ab.redraw()
    timeline = ab.timeline
    scored = timeline.scored_at(len(timeline) - 1)
    first = 32 - WARM_UP_MARGIN
    assert scored == first + 39 and [len(timeline.a.record(i).positions) for i in range(3)] == [first, 1, 1]
    assert timeline.a.record(39).evictions_total > 0
    summary = ab.summary.text()
    assert f"ppl after {scored} tokens: full" in summary and "A oldest" in summary and "B sinks" in summary
    assert len(ab.plots.ppl["a"].getData()[0]) == scored
    layout = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
              "--model-seed", "1", "--page-size", "8", "--max-pages", "4", "--teacher-forced", str(text),
              "--tokens", str(scored + 1), "--json"]
    for side, policy in (("a", "oldest"), ("b", "sinks")):
        assert main(["run", *layout, "--policy", policy]) == 0
        run = json.loads(capsys.readouterr().out)
        assert run["tokens"] == scored
        assert timeline.ppl(side, scored) == pytest.approx(run["ppl"], rel=1e-4)
        assert timeline.ppl("full", scored) == pytest.approx(run["full_ppl"], rel=1e-4)
    ab.same_text.setChecked(False)  # free-running again: both decode the prompt
    qtbot.waitUntil(lambda: ab.runner.state == "ready" and not ab.timeline.forced, timeout=10000)


def preset_ab_at_1280_by_720(qtbot, preset, steps: int):
    """The A/B window of `preset` on the synthetic model at 1280 × 720 after `steps` steps, drawn."""
    from pagevis.gui.ab.window import ABWindow

    ab = ABWindow(SYNTH, PROMPT, preset.a, preset.b, title=preset.name)
    qtbot.addWidget(ab)
    ab.resize(1280, 720)
    ab.show()
    ab.start(blocking=True)
    ab.runner.step_blocking(steps)
    ab.redraw()
    qtbot.wait(50)
    return ab


def test_the_ab_grids_write_their_numbers_in_cells_of_24_by_16_at_1280_by_720(qtbot, tmp_path):
    from pagevis.presets import find_preset

    preset = find_preset("streaming")
    ab = preset_ab_at_1280_by_720(qtbot, preset, 3)
    assert preset.point in ab.point.text() and ab.point.isVisible()
    for _, grid, _ in ab.sides:
        grid.graphics.grab()  # paint: the labels size their numbers to the cells
        view = grid.plot.getViewBox()
        cell = view.mapViewToDevice(pg_rect(0, 0, 1, 1)).boundingRect()
        assert grid.states.shape == (8, 8) and cell.width() >= 24 and cell.height() >= 16
        assert grid.labels.pixel_size > 0  # the numbers are written


def pg_rect(x, y, w, h):
    from PySide6.QtCore import QRectF

    return QRectF(x, y, w, h)


def test_the_page_size_presets_32_wide_pages_write_their_numbers_upright_and_legibly(qtbot, tmp_path):
    """B's 2 pages of 32 in half a 1280-px window are ~17 × 75 px cells: across, their numbers were ~6 px; upright
    (a quarter turn, along the cell) they are at least 9 px."""
    from pagevis.presets import find_preset

    ab = preset_ab_at_1280_by_720(qtbot, find_preset("page size"), 60)  # past position 100: three digits
    (_, grid_a, _), (_, grid_b, _) = ab.sides
    for grid in (grid_a, grid_b):
        grid.graphics.grab()
    assert max(side.record(len(ab.timeline) - 1).positions[-1] for side in (ab.timeline.a, ab.timeline.b)) >= 100
    assert grid_b.states.shape == (2, 32) and grid_b.labels.rotated and grid_b.labels.pixel_size >= 9
    assert not grid_a.labels.rotated and grid_a.labels.pixel_size >= 9
    legend = ab.legend.text()
    assert "protected" in legend and "written&nbsp;this&nbsp;step" in legend  # one colour legend for both grids


def test_the_ab_window_has_the_presenters_pace_and_home_end(qtbot, window):
    """The A/B window had no speed control and Home / End did nothing there: it opens at 4 tok/s (a pace an
    audience follows), its speed box sets its runner's, and Home / End go to the first and the newest step."""
    from PySide6.QtWidgets import QApplication

    from pagevis.gui.widgets.transport import PRESENTER_PACE

    ab = open_ab(qtbot, window)
    qtbot.waitUntil(lambda: ab.runner.state == "ready", timeout=10000)
    assert ab.speed.currentText() == PRESENTER_PACE and ab.runner.interval == 0.25
    ab.speed.setCurrentIndex(ab.speed.findText("10 tok/s"))
    assert ab.runner.interval == 0.1
    ab.runner.step_blocking(4)
    ab.activateWindow()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is not None, timeout=3000)
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key_Home)
    assert ab.index == 0
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key_End)
    assert ab.index == len(ab.timeline) - 1 == 3


def test_the_presentation_layout_slows_max_speed_to_the_presenters_pace(qtbot, window):
    from pagevis.gui.widgets.transport import PRESENTER_PACE

    assert window.transport.speed.currentData() == 0.0  # the desk's default: max speed
    window.set_presentation(True)
    assert window.transport.speed.currentText() == PRESENTER_PACE
    window.transport.speed.setCurrentIndex(window.transport.speed.findText("1 tok/s"))
    window.set_presentation(False)
    window.set_presentation(True)
    assert window.transport.speed.currentText() == "1 tok/s"  # a speed the presenter chose stays

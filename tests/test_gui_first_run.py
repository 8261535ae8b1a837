"""The first frame, before any step: the pool of free pages, empty plots on sensible axes with a hint, and a
first window that fits the screen with no dock squeezed below its content's minimum.

Screen sizes need their own QApplication (the offscreen platform's screen is fixed when it starts), so the
geometry checks run a short script under `QT_QPA_PLATFORM=offscreen:configfile=…` with a given screen."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("pytestqt")
from gui_helpers import CONFIG, make_window, step

from pagevis.viewmodel.cells import FREE
from pagevis.viewmodel.view_state import EMPTY_HINT


@pytest.fixture
def fresh(qtbot, tmp_path):
    """A window whose session started, once its first frame (drawn by the window's own timer) is up."""
    window = make_window(qtbot, tmp_path)
    qtbot.waitUntil(lambda: window.page_grid.states.size > 0, timeout=5000)
    window.docks["Metrics"].raise_()  # on a small screen its tab sits behind the events, and is drawn when raised
    return window


def test_before_the_first_step_the_grid_shows_the_whole_pool_free(qtbot, fresh):
    assert len(fresh.timeline) == 0 and fresh.timeline is not None
    grid = fresh.page_grid
    pages, page_size = CONFIG.max_pages, CONFIG.page_size
    assert grid.states.shape == (pages, page_size) and (grid.states == FREE).all()
    assert grid.image.extent == (pages, page_size) and grid.image.rgba.size > 0
    ticks = grid.plot.getAxis("left")._tickLevels
    # every page labelled at its centre, over the levels pyqtgraph draws while they fit (page_grid.cell_ticks)
    assert sorted((value, label) for level in ticks for value, label in level) == [(p + 0.5, str(p)) for p in range(pages)]
    (x0, x1), (y0, y1) = grid.plot.vb.viewRange()
    assert x0 < 0.5 and x1 > page_size - 0.5 and y0 < 0.5 and y1 > pages - 0.5  # the pool, not −400…400
    assert "all free" in grid.plot.titleLabel.text
    assert grid.cell_info(0, 0) == "page 0, slot 0: free"
    assert grid.blocks.rows == []


def test_empty_plots_have_sensible_axes_and_a_hint_that_goes_after_a_step(qtbot, fresh):
    attention, metrics = fresh.attention, fresh.metrics
    for hint in (attention.hint, metrics.hint):
        assert hint.isVisible() and EMPTY_HINT in hint.toPlainText().replace("\n", " ")
    (ax0, ax1), (ay0, ay1) = attention.plot.vb.viewRange()
    prompt = len(fresh.timeline.info.prompt_ids)
    assert ax0 == pytest.approx(0, abs=1) and prompt <= ax1 <= 4 * max(prompt, 32)  # positions the prefill fills
    assert ay0 == pytest.approx(0, abs=1) and ay1 >= 8
    (mx0, mx1), (my0, my1) = metrics.occupancy.vb.viewRange()
    capacity = CONFIG.capacity
    assert mx0 <= 0 and mx1 >= 16 and my0 <= 0 and capacity <= my1 <= 2 * capacity  # room for the cache
    assert metrics.capacity.value() == capacity and metrics.oracle_off.isVisible()
    assert not any(line.isVisible() for line in metrics.cursors) and not attention.cursor.isVisible()

    step(qtbot, fresh)
    assert not attention.hint.isVisible() and not metrics.hint.isVisible()
    assert attention.cursor.isVisible()
    shown = [line for line in metrics.cursors if line.getViewBox().isVisible()]  # a hidden plot hides its line
    assert len(shown) >= 4 and all(line.isVisible() for line in shown)
    assert attention.matrix.shape[0] == 1 and (fresh.page_grid.states != FREE).any()


_FIRST_WINDOW = r"""
import json, sys
from PySide6.QtCore import QSettings, QRect
from PySide6.QtWidgets import QApplication
app = QApplication([])
from pagevis.gui.widgets import theme
theme.apply(app)
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.gui.session.window import MainWindow

def measure(window):
    app.processEvents()
    docks = {}
    for title, dock in window.docks.items():
        if dock.isHidden():
            continue
        inner = dock.widget()
        need = max(inner.minimumSize().width(), inner.minimumSizeHint().width())
        docks[title] = [inner.width(), need, dock.width(), dock.minimumSizeHint().width()]
    area = window.screen().availableGeometry()
    frame = window.frameGeometry()
    return {"area": [area.x(), area.y(), area.width(), area.height()],
            "frame": [frame.x(), frame.y(), frame.width(), frame.height()], "docks": docks}

settings = QSettings(sys.argv[1], QSettings.IniFormat)
window = MainWindow(settings=settings)  # a first run: nothing saved yet
window.apply_arguments(ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1),
                       "hello", SessionConfig(page_size=4, max_pages=4))
window.show()
first = measure(window)
window.setGeometry(QRect(40, 30, 1200, 640))  # the user's own geometry, saved on close
app.processEvents()
window.close()
again = MainWindow(settings=QSettings(sys.argv[1], QSettings.IniFormat))
again.show()
second = measure(again)
again.close()
print(json.dumps({"first": first, "second": second}), flush=True)
import os
os._exit(0)  # no teardown of two windows and the application at exit: only the measurements matter
"""


@pytest.mark.slow
@pytest.mark.parametrize("width, height", [(1600, 1000), (1280, 720)])  # the screen; a small laptop
def test_the_first_window_fits_the_screen_centred_and_no_dock_is_squeezed(tmp_path, width, height):
    screen = {"screens": [{"name": "test", "x": 0, "y": 0, "width": width, "height": height,
                           "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}
    config = tmp_path / "screen.json"
    config.write_text(json.dumps(screen))
    env = dict(os.environ, QT_QPA_PLATFORM=f"offscreen:configfile={config}")
    done = subprocess.run([sys.executable, "-c", _FIRST_WINDOW, str(tmp_path / "settings.ini")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first = result["first"]
    ax, ay, aw, ah = first["area"]
    fx, fy, fw, fh = first["frame"]
    assert (aw, ah) == (width, height)
    assert ax <= fx and ay <= fy and fx + fw <= ax + aw and fy + fh <= ay + ah  # on the screen
    assert fw >= 0.8 * aw and fh >= 0.8 * ah  # a large share of it (85 %, or the window's minimum)
    assert abs((fx + fw / 2) - (ax + aw / 2)) <= 2 and abs((fy + fh / 2) - (ay + ah / 2)) <= 2  # centred
    for title, (inner, need, outer, outer_need) in first["docks"].items():
        assert inner >= need and outer >= outer_need, (title, inner, need)
    assert set(first["docks"]) >= {"Controls", "Page grid", "Attention", "Text", "Eviction events", "Metrics"}
    attention, grid = first["docks"]["Attention"][2], first["docks"]["Page grid"][2]
    assert attention >= 0.6 * grid  # the heatmap keeps about its share next to the grid
    # once the user's geometry is saved, it is the one restored (no more fitting to the screen)
    assert result["second"]["frame"][2:] != first["frame"][2:]
    assert np.allclose(result["second"]["frame"][2:], [1200, 640], atol=40)


def test_while_the_model_loads_the_views_show_the_pool_it_will_have(qtbot, tmp_path):
    from gui_helpers import PROMPT, SYNTH
    from PySide6.QtCore import QSettings

    from pagevis.gui.session.window import MainWindow

    window = MainWindow(settings=QSettings(str(tmp_path / "gui.ini"), QSettings.IniFormat), restore=False)
    qtbot.addWidget(window)
    # before any session: no pyqtgraph default axes (−0.5…0.5 shown as "x0.001"), nothing negative
    for plot in (window.page_grid.plot, window.attention.plot, window.metrics.occupancy):
        (x0, x1), (y0, y1) = plot.vb.viewRange()
        assert x0 > -1 and y0 > -1 and x1 >= 1 and y1 >= 1
    assert window.attention.hint.toPlainText() == "no session"
    window.apply_arguments(SYNTH, PROMPT, CONFIG)
    window.show()
    window.docks["Metrics"].raise_()  # on a small screen its tab sits behind the events
    window.start()  # the loader's result arrives through the event loop: until then, the state is "loading"
    assert window.runner.state == "loading" and window.timeline is None
    state = window.renderer.view_state()
    assert state.loading == window.controls.session_config() and state.config == state.loading
    window.redraw()
    assert window.page_grid.states.shape == (CONFIG.max_pages, CONFIG.page_size)
    assert (window.page_grid.states == FREE).all()
    assert "loading" in window.attention.hint.toPlainText() and window.attention.hint.isVisible()
    assert window.metrics.capacity.value() == CONFIG.capacity
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=120_000)
    window.redraw()
    assert EMPTY_HINT in window.attention.hint.toPlainText()

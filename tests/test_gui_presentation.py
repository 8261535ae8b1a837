"""The presentation layout (View ▸ Presentation, F5, --present): the page grid fills the window, big enough to read
from the back of a room at a projector's 1280 × 720; the other views are tabs; switching back restores the docks."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import make_window  # noqa: E402
from PySide6.QtCore import QRectF, Qt  # noqa: E402

from pagevis.engine import ModelSpec  # noqa: E402
from pagevis.presets import DEFAULT_CONFIG, default_prompt  # noqa: E402

PROJECTOR = (1280, 720)


@pytest.fixture
def window(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, spec=ModelSpec(kind="synthetic"), prompt=default_prompt("synthetic"),
                         config=DEFAULT_CONFIG)  # 12 pages × 8 slots
    window.resize(*PROJECTOR)
    return window


def cell_pixels(grid) -> tuple[float, float]:
    """One cell's size on the screen, in device-independent pixels."""
    box = grid.plot.vb.mapViewToScene(QRectF(0, 0, 1, 1)).boundingRect()
    return box.width(), box.height()


def test_a_12_x_8_grid_reads_from_the_back_of_the_room_at_1280_x_720(qtbot, window):
    window.set_presentation(True)
    window.runner.step_blocking(30)
    qtbot.wait(30)  # the docks take their new sizes
    window.redraw()
    grid = window.page_grid
    grid.graphics.viewport().repaint()  # the numbers get their size when painted
    width, height = cell_pixels(grid)
    assert grid.states.shape == (12, 8)
    assert width >= 28 and height >= 18, (width, height)
    assert grid.labels.point_size(grid.graphics.logicalDpiY()) >= 9
    assert not grid.blocks.isVisible()  # the cells' numbers say what each page holds
    note = grid.blocks.horizontalHeaderItem(2).toolTip()  # what vLLM users ask: pages per layer, mixed positions
    assert "per layer" in note and "oldest-page" in note and note == grid.block_title.toolTip()
    window.set_presentation(False)  # the normal layout at the same size: the grid shares its row
    qtbot.wait(30)
    window.redraw()
    grid.graphics.viewport().repaint()
    assert cell_pixels(grid)[1] < height and grid.blocks.isVisible()


def test_f11_switches_layouts_and_back_restores_the_docks(qtbot, window):
    docks = window.docks
    attention_area = window.dockWidgetArea(docks["Attention"])
    window.setFocus()
    qtbot.keyClick(window, Qt.Key_F5)
    assert window.presentation and window.presentation_action.isChecked()
    # the other views are tabs behind the grid; the controls a tab behind the text
    assert {docks[t] for t in ("Attention", "Heads", "Weights", "Eviction events", "Metrics")} <= set(
        window.tabifiedDockWidgets(docks["Page grid"]))
    assert docks["Controls"] in window.tabifiedDockWidgets(docks["Text"])
    assert window.narration.font().pixelSize() >= 18 or window.narration.fontInfo().pixelSize() >= 18
    qtbot.keyClick(window, Qt.Key_F5)
    assert not window.presentation
    assert window.dockWidgetArea(docks["Attention"]) == attention_area
    assert docks["Attention"] not in window.tabifiedDockWidgets(docks["Page grid"])


def test_the_layout_is_saved_and_restored(qtbot, tmp_path, window):
    window.set_presentation(True)
    window.save_settings()
    again = make_window(qtbot, tmp_path, spec=ModelSpec(kind="synthetic"), prompt=default_prompt("synthetic"),
                        config=DEFAULT_CONFIG, restore=True)
    assert again.presentation and again.page_grid.presentation

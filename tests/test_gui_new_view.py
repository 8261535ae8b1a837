"""A new view of the main window is one class and one entry in the window's list of views: it gets a dock
(a tab behind the heatmap when the layout names no place for it) and every redraw gives it the ViewState."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget  # noqa: E402

from gui_helpers import make_window, step  # noqa: E402


class StepNumberView(QWidget):
    """The smallest view: the protocol is a title, show_state(ViewState) and export_target()."""

    title = "Step number"

    def __init__(self):
        super().__init__()
        self.label = QLabel("no step")
        QVBoxLayout(self).addWidget(self.label)
        self.states = []

    def show_state(self, state) -> None:
        self.states.append(state)
        record = state.record
        self.label.setText("no step" if record is None else f"step {record.step}")

    def export_target(self):
        return self


def test_a_view_in_the_list_is_docked_as_a_tab_and_drawn_from_the_view_state(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    view = StepNumberView()
    window.views.append(view)  # what the window's __init__ does with one more entry in self.views
    window._add_dock(view, view.title)
    window.reset_layout()
    dock = window.docks[view.title]
    assert window.dockWidgetArea(dock) == window.dockWidgetArea(window.docks["Attention"]) != Qt.NoDockWidgetArea
    assert dock in window.tabifiedDockWidgets(window.docks["Attention"])
    dock.raise_()
    step(qtbot, window, 2)
    assert view.states and view.states[-1].record is window.timeline.record(window.index)
    assert view.label.text() == f"step {window.timeline.record(window.index).step}"

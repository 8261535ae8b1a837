"""What a frame costs the window while decoding: a frame changes the narration, the transport's step and the status
bar's step and speed, and none of that lays the main window out again (a relayout repainted every dock)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QEvent, QObject  # noqa: E402

from gui_helpers import step  # noqa: E402


class LayoutRequests(QObject):
    """Counts the layout requests the main window receives."""

    def __init__(self, window):
        super().__init__()
        self.window, self.count = window, 0
        window.installEventFilter(self)

    def eventFilter(self, watched, event):
        if watched is self.window and event.type() == QEvent.LayoutRequest:
            self.count += 1
        return False


def test_frames_whose_texts_change_do_not_lay_the_main_window_out(qtbot, window):
    step(qtbot, window, 12)
    qtbot.wait(20)
    requests = LayoutRequests(window)
    narrations = set()
    for index in (3, 9, 11, 10, 5, 11):  # each frame a new step: its narration, transport and status texts change
        window.scrub(index)
        qtbot.wait(5)
        narrations.add(window.narration.text())
        assert window.transport.position.text().startswith(f"step {index} / 11")
        assert window.status_step.text().startswith(f"step {index}:")
    assert len(narrations) == 5 and requests.count == 0
    # the texts are whole: each label as wide as its text (the narration: the window's width)
    for label in (window.transport.position, window.status_step, window.status_speed):
        assert label.width() >= label.sizeHint().width() and label.isVisible()
    assert window.narration.width() >= window.width() - 40


def test_a_new_session_gives_the_status_bar_its_room_back(qtbot, window):
    step(qtbot, window, 2)
    wide = window.status_step.holder.width()
    window.restart("reset", blocking=True)
    qtbot.waitUntil(lambda: window.status_step.text() == "step —")
    qtbot.waitUntil(lambda: window.status_step.holder.width() < wide)

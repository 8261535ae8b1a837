"""The extra windows open beside the main window and on its screen, and Ctrl+W, Esc and Ctrl+Q close them."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from gui_helpers import CONFIG, PROMPT  # noqa: E402


def test_ab_sequences_and_server_open_cascaded_from_the_main_window_on_its_screen(qtbot, window):
    from pagevis.gui.widgets.windows import CASCADE

    area = (window.screen() or QGuiApplication.primaryScreen()).availableGeometry()
    window.resize(min(area.width(), 700), min(area.height(), 500))
    window.move(area.topLeft())
    origin = window.frameGeometry().topLeft()
    ab = window.open_ab(CONFIG, CONFIG, PROMPT)
    seqs = window.open_sequences()
    server = window.open_server()
    for w in (ab, seqs, server):
        qtbot.addWidget(w)
    qtbot.waitUntil(server.run_button.isChecked, timeout=3000)  # it runs at once (View ▸ Server): pause it
    server.run_button.setChecked(False)
    qtbot.waitUntil(lambda: server.worker is None, timeout=10000)
    for steps, w in enumerate((ab, seqs, server), start=1):
        geometry = w.geometry()
        if w.minimumSizeHint().width() <= area.width() and w.minimumSizeHint().height() <= area.height():
            assert area.contains(geometry), (type(w).__name__, geometry, area)  # wholly on the screen
        assert area.contains(geometry.topLeft())
        wanted = origin + steps * CASCADE * type(origin)(1, 1)
        if area.contains(geometry.translated(wanted - geometry.topLeft())):  # room to cascade (the offscreen
            assert geometry.topLeft() == wanted  # screen is small: a window its size stays at its corner)


def test_place_beside_cascades_and_keeps_windows_on_the_screen(qtbot):
    from PySide6.QtCore import QPoint, QSize
    from PySide6.QtWidgets import QWidget

    from pagevis.gui.widgets.windows import CASCADE, place_beside

    anchor = QWidget()
    qtbot.addWidget(anchor)
    area = (anchor.screen() or QGuiApplication.primaryScreen()).availableGeometry()
    anchor.setGeometry(area.left() + 10, area.top() + 10, 200, 150)
    placed = []
    for steps in (1, 2, 3):
        w = QWidget()
        qtbot.addWidget(w)
        w.resize(300, 200)
        place_beside(w, anchor, steps)
        placed.append(w.geometry())
    origin = anchor.frameGeometry().topLeft()
    assert [g.topLeft() for g in placed] == [origin + QPoint(s * CASCADE, s * CASCADE) for s in (1, 2, 3)]
    huge = QWidget()
    qtbot.addWidget(huge)
    huge.resize(area.size() + QSize(500, 500))
    place_beside(huge, anchor, 3)
    assert huge.geometry() == area  # as large as the screen allows, and on it


@pytest.mark.parametrize("keys", [(Qt.Key_W, Qt.ControlModifier), (Qt.Key_Escape, Qt.NoModifier),
                                  (Qt.Key_Q, Qt.ControlModifier)], ids=["ctrl-w", "esc", "ctrl-q"])
def test_the_server_window_alone_closes_with_the_usual_keys(qtbot, keys):
    from pagevis.engine import ModelSpec
    from pagevis.gui.server.window import ServerWindow

    server = ServerWindow(ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16).load(),
                          realtime=False)  # as --server-demo opens it: no main window
    qtbot.addWidget(server)
    server.show()
    server.activateWindow()
    qtbot.waitUntil(server.isActiveWindow, timeout=3000)
    qtbot.keyClick(server, *keys)
    qtbot.waitUntil(lambda: not server.isVisible(), timeout=3000)


def test_the_attached_server_window_opens_within_its_screen(qtbot):
    """`pagevis --server-events …` opened the Server window at 1600 × 1000 on a 1280 × 720 screen (plots and
    header cut off); it opens at most the screen's size, wholly on it, and its layout fits 1280 × 720."""
    from pagevis.gui import attached_server_window
    from pagevis.engine import ModelSpec

    window = attached_server_window(ModelSpec(kind="synthetic"), None, None)
    qtbot.addWidget(window)
    area = window.screen().availableGeometry()
    assert area.contains(window.geometry())
    hint = window.minimumSizeHint()
    assert hint.width() <= 1280 and hint.height() <= 720

"""Where the app's extra windows open, and the keys that close them."""

from __future__ import annotations

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import QApplication, QWidget

CASCADE = 40  # pixels each extra window opens down and right of the one before


def place_beside(window: QWidget, anchor: QWidget | None, steps: int = 1) -> None:
    """Open `window` cascaded `steps` × CASCADE from `anchor`'s top left, at most the size of `anchor`'s
    screen and wholly on it (Qt opened them at (0, 0), over the main window)."""
    screen = (anchor.screen() if anchor is not None else None) or QGuiApplication.primaryScreen()
    if screen is None:
        return
    area = screen.availableGeometry()
    size = window.size().boundedTo(area.size())
    origin = anchor.frameGeometry().topLeft() if anchor is not None else area.topLeft()
    x = min(max(origin.x() + steps * CASCADE, area.left()), area.right() + 1 - size.width())
    y = min(max(origin.y() + steps * CASCADE, area.top()), area.bottom() + 1 - size.height())
    window.setGeometry(QRect(x, y, size.width(), size.height()))


def add_close_keys(window: QWidget) -> None:
    """Ctrl+W and Esc close the window; Ctrl+Q quits (closes every window), as in the main window."""
    for keys in ("Ctrl+W", Qt.Key_Escape):
        QShortcut(QKeySequence(keys), window, window.close)
    QShortcut(QKeySequence("Ctrl+Q"), window, QApplication.closeAllWindows)

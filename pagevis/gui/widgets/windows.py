"""Where the app's extra windows open, and the keys that close them."""

from __future__ import annotations

from PySide6.QtCore import QMargins, QRect, Qt
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import QApplication, QWidget

CASCADE = 40  # pixels each extra window opens down and right of the one before


def frame_margins(window: QWidget, like: QWidget | None = None) -> QMargins:
    """The window manager's frame around `window`: its own once it has one, else that of `like` or of another
    shown window of the app (the same decoration), else none."""
    candidates = [window, like] + [w for w in QApplication.topLevelWidgets() if w.isVisible()]
    for w in candidates:
        if w is None or not w.isWindow():
            continue
        frame, inner = w.frameGeometry(), w.geometry()
        margins = QMargins(inner.left() - frame.left(), inner.top() - frame.top(), frame.right() - inner.right(),
                           frame.bottom() - inner.bottom())
        if not margins.isNull():
            return margins
    return QMargins()


def set_frame_geometry(window: QWidget, frame: QRect, like: QWidget | None = None) -> None:
    """Place `window` so that its frame (title bar and borders included) is `frame`: setGeometry alone sizes the
    inside, and a window the size of the screen's area overhung it by its frame (cut off on a 1280 × 720
    projector)."""
    window.setGeometry(frame.marginsRemoved(frame_margins(window, like)))


def place_beside(window: QWidget, anchor: QWidget | None, steps: int = 1) -> None:
    """Open `window` cascaded `steps` × CASCADE from `anchor`'s top left, at most the size of `anchor`'s
    screen and wholly on it, frame included (Qt opened them at (0, 0), over the main window)."""
    screen = (anchor.screen() if anchor is not None else None) or QGuiApplication.primaryScreen()
    if screen is None:
        return
    area = screen.availableGeometry()
    margins = frame_margins(window, anchor)
    size = window.size().grownBy(margins).boundedTo(area.size())
    origin = anchor.frameGeometry().topLeft() if anchor is not None else area.topLeft()
    x = min(max(origin.x() + steps * CASCADE, area.left()), area.right() + 1 - size.width())
    y = min(max(origin.y() + steps * CASCADE, area.top()), area.bottom() + 1 - size.height())
    window.setGeometry(QRect(x, y, size.width(), size.height()).marginsRemoved(margins))


def add_close_keys(window: QWidget) -> None:
    """Ctrl+W and Esc close the window; Ctrl+Q quits (closes every window), as in the main window."""
    for keys in ("Ctrl+W", Qt.Key_Escape):
        QShortcut(QKeySequence(keys), window, window.close)
    QShortcut(QKeySequence("Ctrl+Q"), window, QApplication.closeAllWindows)

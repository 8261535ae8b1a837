"""Help ▸ Tour: the three windows that show what paging does, one after another, each on real sessions of the
main window's model, with one line on what to look at. The tour only opens and starts the windows; they run as
they do when opened by hand. One step's window at a time: the next step closes the one before, and Finish (or
Close, Esc) closes the last, so nothing the tour started keeps running after it."""

from __future__ import annotations

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from pagevis.gui.widgets.windows import add_close_keys, frame_margins, set_frame_geometry
from pagevis.presets import find_preset

STEPS = (
    ("1 / 3 · StreamingLLM", "Both read the same text: A keeps a window of the newest tokens, B also keeps 4 sink "
                             "tokens. At the first eviction A's perplexity curve leaves the full cache's; B's stays "
                             "with it."),
    ("2 / 3 · Sequences", "Four samples of one prompt in one pool: amber pages are shared (×N: by N sequences), "
                          "and the bars compare pages used with sharing, without it, and a contiguous reservation."),
    ("3 / 3 · Server", "Requests arrive with one system prompt: A (prefix caching on) computes its pages once and "
                       "reuses them, B computes them for every request; compare the hit rate and TTFT rows."),
)


class Tour(QWidget):
    """A small window beside the main one: the step's title and line, Next and Close."""

    def __init__(self, main):
        super().__init__(main, Qt.Window)
        self.main = main
        self.index = -1
        self.opened: list[QWidget] = []  # the window the current step opened
        self.setWindowTitle("pagevis — tour")
        self.title = QLabel()
        self.title.setStyleSheet("font-weight: bold; font-size: 14px;")
        self.line = QLabel()
        self.line.setWordWrap(True)
        self.next_button = QPushButton("Next")
        self.close_button = QPushButton("Close")
        self.next_button.clicked.connect(self.next)
        self.close_button.clicked.connect(self.close)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.next_button)
        buttons.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.title)
        layout.addWidget(self.line, 1)
        layout.addLayout(buttons)
        add_close_keys(self)
        self.resize(460, 130)

    def start(self) -> None:
        self._to_corner()
        self.show()
        self.index = -1
        self.next()

    def _to_corner(self) -> None:
        """The screen's bottom right corner: the windows the tour opens cascade from the top left (where it sat
        over the A/B window's first grid)."""
        screen = self.main.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        area = screen.availableGeometry()
        size = self.size().grownBy(frame_margins(self, self.main)).boundedTo(area.size())
        set_frame_geometry(self, QRect(area.right() + 1 - size.width(), area.bottom() + 1 - size.height(),
                                       size.width(), size.height()), self.main)

    def next(self) -> None:
        """Open the next step's window; a step that needs the model waits for it (it says so)."""
        index = self.index + 1
        if index >= len(STEPS):
            self.close()
            return
        if index > 0 and self.main.runner.model is None:
            self.line.setText("The model is still loading: press Next once the main window has it.")
            return
        self.index = index
        self.title.setText(STEPS[index][0])
        self.line.setText(STEPS[index][1])
        self.next_button.setText("Next" if index < len(STEPS) - 1 else "Finish")
        self._close_opened()
        if index == 0:
            self.main.apply_preset(find_preset("streaming"))  # the A/B window, both sides playing
            opened = self.main.ab_window
        elif index == 1:
            opened = self.main.open_sequences()
            if opened is not None and opened.start():
                opened.run_button.setChecked(True)
        else:
            opened = self.main.open_server()  # it serves at once
        if opened is not None:
            self.opened.append(opened)
        self.raise_()

    def _close_opened(self) -> None:
        """Close the window the step before opened (it stops its sessions, workers and timers)."""
        for window in self.opened:
            window.close()
        self.opened = []

    def closeEvent(self, event) -> None:
        self._close_opened()
        super().closeEvent(event)

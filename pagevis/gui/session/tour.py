"""Help ▸ Tour: the three windows that show what paging does, one after another, each on real sessions of the
main window's model, with one line on what to look at. The tour only opens and starts the windows; they run as
they do when opened by hand."""

from __future__ import annotations

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from pagevis.gui.widgets.windows import add_close_keys
from pagevis.presets import find_preset

STEPS = (
    ("1 / 3 · StreamingLLM", "Both read the same text: A keeps a window of the newest tokens, B also keeps 4 sink "
                             "tokens. At the first eviction A's perplexity curve leaves the full cache's; B's stays "
                             "with it."),
    ("2 / 3 · Sequences", "Four samples of one prompt in one pool: amber pages are shared (×4), and the bars "
                          "compare pages used with sharing, without it, and a contiguous reservation."),
    ("3 / 3 · Server", "Requests arrive with one system prompt: A (prefix caching on) computes its pages once and "
                       "reuses them, B computes them for every request; compare the hit rate and TTFT rows."),
)


class Tour(QWidget):
    """A small window beside the main one: the step's title and line, Next and Close."""

    def __init__(self, main):
        super().__init__(main, Qt.Window)
        self.main = main
        self.index = -1
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
        size = self.size().boundedTo(area.size())
        self.setGeometry(QRect(area.right() + 1 - size.width(), area.bottom() + 1 - size.height(), size.width(),
                               size.height()))

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
        if index == 0:
            self.main.apply_preset(find_preset("streaming"))  # the A/B window, both sides playing
        elif index == 1:
            sequences = self.main.open_sequences()
            if sequences is not None and sequences.start():
                sequences.run_button.setChecked(True)
        else:
            self.main.open_server()  # it serves at once
        self.raise_()

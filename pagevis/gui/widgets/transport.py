"""The transport toolbar: step, play/pause, speed, reset and the timeline slider."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QColor, QImage, QKeySequence, QPixmap
from PySide6.QtWidgets import QComboBox, QLabel, QSlider, QStyle, QStyleOptionSlider, QToolBar, QWidget

from pagevis.gui.widgets.steady_label import SteadyLabel
from pagevis.gui.widgets.theme import icon
from pagevis.viewmodel.cells import STATE_COLORS

SPEEDS = (("max speed", 0.0), ("30 tok/s", 1 / 30), ("10 tok/s", 0.1), ("4 tok/s", 0.25), ("1 tok/s", 1.0))
PRESENTER_PACE = "4 tok/s"  # the presentation layout's, the presets' and the A/B window's pace: an audience reads it


def speed_box(default: str = SPEEDS[0][0]) -> QComboBox:
    """The playback speed choice (seconds per step as its data), showing `default`; it never takes the focus:
    the arrow keys belong to step / scrub."""
    box = QComboBox()
    for label, seconds in SPEEDS:
        box.addItem(label, seconds)
    box.setCurrentIndex(max(box.findText(default), 0))
    box.setToolTip("playback speed")
    box.setFocusPolicy(Qt.NoFocus)
    return box


class TimelineCursor:
    """Which recorded step a timeline window shows (a part the main and the A/B window hold, `window.cursor`):
    → moves through the recorded steps and decodes only at the newest (or never, in a replay); scrubbing to the
    newest record follows new records again. It reads the window's `timeline` and `runner`, sets its `index` and
    `follow`, and calls its `redraw()`."""

    def __init__(self, window):
        self.window = window

    def step(self) -> None:
        w = self.window
        if w.timeline is not None and (w.index < len(w.timeline) - 1 or w.runner.state == "replay"):
            self.scrub(w.index + 1)
            return
        if w.runner.busy:
            return
        w.follow = True
        w.runner.step(1)

    def scrub(self, index: int) -> None:
        w = self.window
        if w.timeline is None or not len(w.timeline):
            return
        w.index = max(0, min(index, len(w.timeline) - 1))
        w.follow = w.index == len(w.timeline) - 1
        w.redraw()


class MarkedSlider(QSlider):
    """The timeline slider, with a red tick under every step that evicted (any layer). The ticks are a pixmap
    in a QLabel child: no Python paintEvent, so Qt paints the slider without taking the GIL, which the worker
    thread needs for decoding (a Python paintEvent held it through the slider's whole C++ paint)."""

    TICK_HEIGHT = 5

    def __init__(self):
        super().__init__(Qt.Horizontal)
        self.marks = np.zeros(0, dtype=np.int64)
        self.ticks = QLabel(self)
        self.ticks.setAttribute(Qt.WA_TransparentForMouseEvents)
        self.ticks.setScaledContents(False)
        self._ticks_key = None
        self._track_size, self._track_geometry = None, (0.0, 0.0)

    def set_marks(self, steps: np.ndarray) -> None:
        """The steps to mark; call it after changing the range too (the ticks move with it)."""
        if len(steps) != len(self.marks) or not np.array_equal(steps, self.marks):
            self.marks = np.asarray(steps, dtype=np.int64)
        self._place_ticks()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._place_ticks()

    def _track(self) -> tuple[float, float]:
        """(x of the minimum's handle centre, pixels from minimum to maximum): the style's geometry, which
        changes only with the slider's size."""
        size = (self.width(), self.height())
        if self._track_size != size:
            option = QStyleOptionSlider()
            self.initStyleOption(option)
            groove = self.style().subControlRect(QStyle.CC_Slider, option, QStyle.SC_SliderGroove, self)
            handle = self.style().subControlRect(QStyle.CC_Slider, option, QStyle.SC_SliderHandle, self)
            self._track_size = size
            self._track_geometry = (groove.left() + handle.width() / 2, groove.width() - handle.width())
        return self._track_geometry

    def tick_columns(self) -> np.ndarray:
        """The pixel columns (slider coordinates) of the ticks, one per column however many steps share it."""
        left, span = self._track()
        x = left + (self.marks - self.minimum()) * (span / (self.maximum() - self.minimum()))
        columns = np.zeros(max(self.width(), 1), dtype=bool)
        columns[np.clip(np.round(x).astype(np.int64), 0, len(columns) - 1)] = True
        return np.flatnonzero(columns)

    def _place_ticks(self) -> None:
        visible = bool(self.marks.size) and self.maximum() > self.minimum()
        key = (len(self.marks), self.minimum(), self.maximum(), self.width(), self.height()) if visible else None
        if key == self._ticks_key:
            return
        self._ticks_key = key
        self.ticks.setVisible(visible)
        if not visible:
            return
        strip = np.zeros((self.TICK_HEIGHT, self.width()), dtype=np.uint32)  # transparent ARGB32
        strip[:, self.tick_columns()] = QColor(STATE_COLORS[5]).rgba()
        image = QImage(strip.data, strip.shape[1], strip.shape[0], strip.strides[0], QImage.Format_ARGB32)
        self.ticks.setPixmap(QPixmap.fromImage(image))  # fromImage copies: the array may go
        self.ticks.setGeometry(0, self.height() - self.TICK_HEIGHT, self.width(), self.TICK_HEIGHT)


class TransportBar(QToolBar):
    scrubbed = Signal(int)  # the user moved the slider to a record index
    speed_changed = Signal(float)  # seconds per step (0: as fast as the model goes)

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Transport", parent)
        self.setObjectName("transport")
        self.setMovable(False)
        self.play_action = QAction(icon("play"), "Play", self)
        self.play_action.setShortcut(QKeySequence(Qt.Key_Space))
        self.play_action.setToolTip("Play / pause (Space)")
        self.step_action = QAction(icon("step"), "Step", self)
        self.step_action.setShortcut(QKeySequence(Qt.Key_Right))
        self.step_action.setToolTip("Next recorded step when scrubbed back; at the newest, decode one token (→)")
        self.reset_action = QAction(icon("reset"), "Reset", self)
        self.reset_action.setShortcut(QKeySequence("Ctrl+R"))
        self.reset_action.setToolTip("Restart the session from the prompt (Ctrl+R)")
        self.previous_action = QAction("Back to previous run", self)
        self.previous_action.setShortcut(QKeySequence.Undo)
        self.previous_action.setToolTip("Every restart keeps the run before it: swap back to it (Ctrl+Z)")
        self.previous_action.setEnabled(False)
        self.back_action = QAction("Back", self)
        self.back_action.setShortcuts([QKeySequence(Qt.Key_Left), QKeySequence("Ctrl+Left")])
        self.forward_action = QAction("Forward", self)
        self.forward_action.setShortcut(QKeySequence("Ctrl+Right"))
        self.first_action = QAction("First step", self)
        self.first_action.setShortcut(QKeySequence(Qt.Key_Home))
        self.last_action = QAction("Latest step", self)
        self.last_action.setShortcut(QKeySequence(Qt.Key_End))
        for action in (self.play_action, self.step_action, self.reset_action):
            self.addAction(action)
        self.speed = speed_box()
        self.speed.currentIndexChanged.connect(lambda *_: self.speed_changed.emit(self.speed.currentData()))
        self.addWidget(self.speed)
        self.addSeparator()
        self.slider = MarkedSlider()
        self.slider.setRange(0, 0)
        self.slider.setFocusPolicy(Qt.NoFocus)  # the arrow keys belong to step / scrub
        self.slider.setToolTip("Scrub to any recorded step (← / →, Home, End); red ticks: steps that evicted")
        self.slider.valueChanged.connect(self._moved)
        self.addWidget(self.slider)
        # set with every frame while decoding: a SteadyLabel, so that a new text does not lay the window out again
        self.position = SteadyLabel("no session")
        self.position.setMinimumWidth(150)
        self.position.setAlignment(Qt.AlignRight | Qt.AlignVCenter)
        self.addWidget(self.position.holder)
        self._updating = False

    def use_presenter_pace(self) -> None:
        """At max speed, slow to the presenter's pace (a preset plays, the presentation layout comes on); a
        speed the user chose stays."""
        if self.speed.currentData() == 0.0:
            self.speed.setCurrentIndex(self.speed.findText(PRESENTER_PACE))

    def set_playing(self, playing: bool) -> None:
        self.play_action.setIcon(icon("pause" if playing else "play"))
        self.play_action.setText("Pause" if playing else "Play")

    def set_range(self, count: int, index: int, label: str) -> None:
        """Show `count` records with `index` selected, without emitting `scrubbed`."""
        self._updating = True
        try:
            self.slider.setRange(0, max(count - 1, 0))
            self.slider.setValue(max(index, 0))
        finally:
            self._updating = False
        self.position.setText(label)

    def _moved(self, value: int) -> None:
        if not self._updating:
            self.scrubbed.emit(value)

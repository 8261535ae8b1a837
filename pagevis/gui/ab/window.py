"""The A/B window: two sessions with different cache settings in lockstep side by side — both page grids above
both texts, the two sides' curves below — either decoding the same prompt (free-running) or reading the same
text (teacher-forced, "same text": the StreamingLLM figure, live, with the full cache's perplexity beside them)."""

from __future__ import annotations

import html
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QLabel,
    QMainWindow,
    QSlider,
    QSplitter,
    QToolBar,
)

from pagevis.engine import ModelSpec, SessionConfig
from pagevis.gui.ab.plots import ABPlots
from pagevis.gui.ab.sides import ABRunner, SideControls
from pagevis.gui.session.runner import validate
from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import splitter, stacked
from pagevis.gui.widgets.page_grid import PageGridView, legend_html
from pagevis.gui.widgets.setting_inputs import spin as _spin
from pagevis.gui.widgets.text import TextView
from pagevis.gui.widgets.transport import PRESENTER_PACE, TimelineCursor, speed_box
from pagevis.gui.widgets.windows import add_close_keys
from pagevis.kvcache import ConfigError
from pagevis.presets import DEFAULT_TEXT, preset_named, shipped_text, shipped_texts
from pagevis.viewmodel.ab_session import ABConfig, ABTimeline, describe, side_labels
from pagevis.viewmodel.view_state import ViewState

FRAME_INTERVAL_MS = 100  # redraw at most 10 times a second while decoding (two grids and two texts)
SIZE = (1280, 720)  # a projector's: two 8 × 8 grids of 24 × 16 px cells with numbers, the curves under them
OPEN_FILE = "Open a file…"


class ABWindow(QMainWindow):
    def __init__(self, spec: ModelSpec, prompt: str, config_a: SessionConfig, config_b: SessionConfig,
                 title: str = "", parent=None, text: str | None = None):
        """title: the window's title — a preset's name shows that preset's point and, if it reads a text,
        starts in "same text" mode on it. text: start in "same text" mode on this text (a shipped text's name
        or a file's path)."""
        super().__init__(parent)
        self.setWindowTitle(f"pagevis — A/B{': ' + title if title else ''}")
        self.setWindowIcon(theme.icon("pagevis"))
        self.preset = preset_named(title)
        self.spec, self.prompt = spec, prompt
        self.runner = ABRunner(self)
        self.cursor = TimelineCursor(self)  # step / scrub: which recorded step both sides show
        self.timeline: ABTimeline | None = None
        self.index = -1
        self.follow = True
        self._drawn_at = 0.0
        self._play_when_ready = False
        self._frame = QTimer(self, singleShot=True)
        self._frame.timeout.connect(self.redraw)
        self._build(config_a, config_b)
        text = text or (self.preset.text if self.preset is not None else None)
        if text:
            self.choose_text(text, restart=False)
        self.plots.set_mode(bool(text), self.side_labels())
        self.runner.started.connect(self._started)
        self.runner.records.connect(self._arrived)
        self.runner.state_changed.connect(self._state_changed)
        add_close_keys(self)
        self.runner.failed.connect(lambda message, _: self.summary.setText(
            f"<span style='color:#ff7a7a'>{html.escape(message)}</span>"))

    # --- construction ----------------------------------------------------------------------------
    def _build(self, config_a: SessionConfig, config_b: SessionConfig) -> None:
        self._build_toolbar()
        self.point = QLabel()  # a preset's point, in one line
        self.point.setStyleSheet(f"font-size: 16px; color: {theme.TEXT}; padding: 2px 6px;")
        self.point.setWordWrap(True)
        if self.preset is not None and self.preset.point:
            self.point.setText(f"<span style='color:{theme.ACCENT}'>&#9656; {html.escape(self.preset.name)}</span>"
                               f": {html.escape(self.preset.point, quote=False)}")
            self.point.setToolTip(self.preset.description)
        else:
            self.point.hide()
        self.sides = []
        columns = QSplitter(Qt.Horizontal)
        for name, config in (("A", config_a), ("B", config_b)):
            controls = SideControls(name, self.restart)
            controls.set_config(config)
            grid, text = PageGridView(), TextView()
            grid.set_presentation(True)  # no block table: the cells' numbers say what each page holds
            grid.legend.hide()  # one legend is enough: the main window explains the colours
            text.legend.hide()
            column = splitter(Qt.Vertical, stacked(controls, (grid, 1), margins=(2, 2, 2, 2)), text,
                              sizes=[330, 90])
            columns.addWidget(column)
            self.sides.append((controls, grid, text))
        self.legend = QLabel(legend_html(hybrid=False, note=False) + f"<span style='color:{theme.MUTED}'>&nbsp;&nbsp; "
                             "protected: what a side's policy never evicts (sinks' first tokens, H2O's recent "
                             "window)</span>")  # one legend for both grids: the colours mean the same
        self.legend.setWordWrap(True)
        self.legend.setStyleSheet("font-size: 11px; padding: 0 4px;")
        self.summary = QLabel()  # the headline: the perplexities (teacher-forced) or where the texts diverge
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.RichText)
        self.summary.setStyleSheet("font-size: 15px;")
        self.plots = ABPlots()
        bottom = stacked(self.legend, self.summary, (self.plots, 1), margins=(4, 2, 4, 2))
        body = splitter(Qt.Vertical, columns, bottom, sizes=[420, 230])
        self.setCentralWidget(stacked(self.point, (body, 1)))
        self.resize(*SIZE)
        self._focus_home = self.sides[0][1].graphics  # ← / → go to the window's actions, not to a spin box
        self._focus_home.setFocusPolicy(Qt.StrongFocus)
        self.redraw()

    def _build_toolbar(self) -> None:
        bar = QToolBar("A/B transport")
        bar.setMovable(False)
        self.addToolBar(bar)
        self.play_action = QAction(theme.icon("play"), "Play", self, shortcut=QKeySequence(Qt.Key_Space))
        self.step_action = QAction(theme.icon("step"), "Step", self, shortcut=QKeySequence(Qt.Key_Right))
        self.step_action.setToolTip("Next recorded step when scrubbed back; at the newest, decode one step of both (→)")
        self.reset_action = QAction(theme.icon("reset"), "Reset", self, shortcut=QKeySequence("Ctrl+R"))
        self.back_action = QAction("Back", self, shortcut=QKeySequence(Qt.Key_Left))
        self.first_action = QAction("First step", self, shortcut=QKeySequence(Qt.Key_Home))
        self.last_action = QAction("Latest step", self, shortcut=QKeySequence(Qt.Key_End))
        for action in (self.play_action, self.step_action, self.reset_action):
            bar.addAction(action)
        self.speed = speed_box(PRESENTER_PACE)
        self.speed.currentIndexChanged.connect(lambda *_: self.runner.set_interval(self.speed.currentData()))
        self.runner.set_interval(self.speed.currentData())
        bar.addWidget(self.speed)
        for action in (self.back_action, self.first_action, self.last_action):
            self.addAction(action)
        self.first_action.triggered.connect(lambda: self.scrub(0))
        self.last_action.triggered.connect(lambda: self.scrub(len(self.timeline) - 1 if self.timeline else -1))
        self.play_action.triggered.connect(self.toggle_play)
        self.step_action.triggered.connect(self.step)
        self.reset_action.triggered.connect(lambda: self.restart("reset"))
        self.back_action.triggered.connect(lambda: self.scrub(self.index - 1))
        bar.addWidget(QLabel(" layer "))
        self.layer = _spin(0, 0, 0, "the layer both grids and texts show")
        self.layer.setFocusPolicy(Qt.ClickFocus)  # opening the window leaves ← / → to the transport
        self.layer.valueChanged.connect(lambda *_: self.redraw())
        bar.addWidget(self.layer)
        self.same_text = QCheckBox("same text")
        self.same_text.setFocusPolicy(Qt.ClickFocus)
        self.same_text.setToolTip("teacher-forced: both sides read the same text one token a step, beside the "
                                  "full cache; the curves are each side's perplexity on it (pagevis compare's "
                                  "numbers). Off: both sides decode the prompt, each sampling its own tokens")
        self.texts = QComboBox()
        self.texts.setFocusPolicy(Qt.ClickFocus)
        for name in shipped_texts():
            self.texts.addItem(name, name)
        self.texts.addItem(OPEN_FILE, None)
        self.texts.setCurrentIndex(max(self.texts.findData(DEFAULT_TEXT), 0))
        self.texts.setEnabled(False)
        self.same_text.toggled.connect(self._same_text_toggled)
        self.texts.activated.connect(self._text_chosen)
        bar.addWidget(self.same_text)
        bar.addWidget(self.texts)
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setFocusPolicy(Qt.NoFocus)
        self.slider.valueChanged.connect(lambda value: None if self._updating else self.scrub(value))
        self._updating = False
        bar.addWidget(self.slider)
        self.position = QLabel("no session")
        self.position.setMinimumWidth(120)
        bar.addWidget(self.position)

    # --- the text read in "same text" mode -------------------------------------------------------
    def choose_text(self, name_or_path: str, restart: bool = True) -> None:
        """Read this text (a shipped text's name or a file's path) in "same text" mode."""
        index = self.texts.findData(name_or_path)
        if index < 0:
            self.texts.insertItem(self.texts.count() - 1, name_or_path.rsplit("/", 1)[-1], name_or_path)
            index = self.texts.count() - 2
        self.texts.setCurrentIndex(index)
        self.same_text.blockSignals(True)
        self.same_text.setChecked(True)
        self.same_text.blockSignals(False)
        self.texts.setEnabled(True)
        if restart:
            self.restart("text chosen")

    def forced_text(self) -> str | None:
        """The text both sides read, or None when they decode the prompt (free-running)."""
        if not self.same_text.isChecked():
            return None
        name = self.texts.currentData()
        text = shipped_text(name)
        if text is not None:
            return text
        with open(name, encoding="utf-8") as handle:
            return handle.read(4 << 20)

    def _same_text_toggled(self, on: bool) -> None:
        self.texts.setEnabled(on)
        self.restart("same text" if on else "free-running")

    def _text_chosen(self, index: int) -> None:
        if self.texts.itemData(index) is None:
            path, _ = QFileDialog.getOpenFileName(self, "A text both sides read", "", "Text (*.txt);;All files (*)")
            if not path:
                self.texts.setCurrentIndex(max(self.texts.findData(DEFAULT_TEXT), 0))
                return
            self.choose_text(path, restart=False)
        self.restart("text chosen")

    # --- sessions --------------------------------------------------------------------------------
    def configs(self) -> ABConfig:
        return ABConfig(self.sides[0][0].config(), self.sides[1][0].config())

    def start(self, blocking: bool = False, play: bool = False) -> None:
        """Start both sessions; with `play`, decode them as soon as the model is ready (a preset)."""
        self._play_when_ready = play
        self.restart("", blocking=blocking)

    def restart(self, reason: str = "reset", blocking: bool = False) -> None:
        configs = self.configs()
        try:
            for config in configs:
                validate(config)
            text = self.forced_text()
        except (ConfigError, OSError, UnicodeDecodeError) as error:
            self.summary.setText(f"<span style='color:#ff7a7a'>Not restarted: {html.escape(str(error))}</span>")
            return
        for controls, _, _ in self.sides:
            controls.update_header()
            controls.oracle.setEnabled(text is None)  # teacher-forced: the full cache is always beside them
        self.plots.set_mode(text is not None, self.side_labels())
        self.runner.configure(self.spec, self.prompt if text is None else text, (configs, text is not None),
                              blocking=blocking)

    def _started(self, timeline: ABTimeline) -> None:
        self.timeline = timeline
        self.index, self.follow = -1, True
        self.layer.setMaximum(timeline.info.n_layers - 1)
        self.summary.setText("Press Space to read the text on both sides, one token a step." if timeline.forced
                             else "Press Space to decode both sessions in lockstep.")
        self.redraw()
        if self._play_when_ready:
            self._play_when_ready = False
            self.toggle_play()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self._focus_home.setFocus(Qt.OtherFocusReason)

    def toggle_play(self) -> None:
        if self.runner.running:
            self.runner.stop()
        else:
            self.follow = True
            self.runner.play()

    def _arrived(self, _items) -> None:
        if self.follow and self.timeline is not None:
            self.index = len(self.timeline) - 1
        if not self._frame.isActive():
            wait = self._drawn_at + FRAME_INTERVAL_MS / 1000 - time.perf_counter()
            self._frame.start(max(0, int(wait * 1000)))

    def _state_changed(self, state: str) -> None:
        playing = state == "running" and self.runner.running
        self.play_action.setIcon(theme.icon("pause" if playing else "play"))
        self.play_action.setText("Pause" if playing else "Play")
        if state != "running":
            self.redraw()
        if state == "done" and self.runner.session is not None:
            self.summary.setText(self.summary.text() + f" — finished ({self.runner.session.stop_reason})")

    # --- drawing ---------------------------------------------------------------------------------
    def step(self) -> None:
        self.cursor.step()

    def scrub(self, index: int) -> None:
        self.cursor.scrub(index)

    def redraw(self) -> None:
        self._frame.stop()
        self._drawn_at = time.perf_counter()
        timeline = self.timeline
        if timeline is None:  # the model loads: each side's empty pool, not pyqtgraph's default axes
            for controls, grid, text in self.sides:
                grid.show_state(ViewState(None, -1, loading=controls.config()))
            return
        layer = min(self.layer.value(), timeline.info.n_layers - 1)
        for (controls, grid, text), side in zip(self.sides, (timeline.a, timeline.b)):
            state = ViewState(side, self.index, layer=layer)
            grid.show_state(state)
            text.show_state(state)
        count = len(timeline)
        self._updating = True
        self.slider.setRange(0, max(count - 1, 0))
        self.slider.setValue(max(self.index, 0))
        self._updating = False
        self.position.setText(f"step {self.index} / {count - 1}" if count else "no steps yet")
        self.plots.show(timeline, self.index)
        self.summary.setText(self.describe())

    def describe(self) -> str:
        """One line: the perplexities so far (teacher-forced), or where the texts diverge and how each side
        is doing (free-running)."""
        return describe(self.timeline, self.index, self.side_labels())

    def side_labels(self) -> tuple[str, str]:
        """The sides' names in every legend and headline ("A sinks, 8×8, frees 8 at once"): never alike."""
        return side_labels(self.configs())

    def closeEvent(self, event) -> None:
        self._frame.stop()
        self.runner.shutdown()
        super().closeEvent(event)

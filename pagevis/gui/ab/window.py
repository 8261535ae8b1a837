"""The A/B window: two sessions on the same prompt with different cache settings, decoding in lockstep side
by side — both page grids, both texts with their evicted tokens, and per step how far apart they are."""

from __future__ import annotations

import html
import time
from dataclasses import replace

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QSlider,
    QSplitter,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError
from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import splitter, stacked
from pagevis.engine.logits_tap import LogitsTap
from pagevis.viewmodel.ab_session import ABConfig, ABTimeline, LockstepPair
from pagevis.gui.widgets.setting_inputs import setting_input
from pagevis.gui.widgets.setting_inputs import spin as _spin
from pagevis.gui.session.runner import SessionRunner, new_session, validate
from pagevis.gui.widgets.transport import TimelineCursor
from pagevis.gui.widgets.windows import add_close_keys
from pagevis.viewmodel.view_state import ViewState
from pagevis.gui.widgets.page_grid import PageGridView
from pagevis.gui.widgets.text import TextView

FRAME_INTERVAL_MS = 100  # redraw at most 10 times a second while decoding (two grids and two texts)


class ABRunner(SessionRunner):
    """A SessionRunner whose session is a LockstepPair and whose timeline is an ABTimeline."""

    def _new_session(self):
        configs: ABConfig = self.config
        taps = LogitsTap(self.model), LogitsTap(self.model)
        a, timeline_a = new_session(taps[0], self.spec, self.prompt, configs.a)
        b, timeline_b = new_session(taps[1], self.spec, self.prompt, configs.b)
        return LockstepPair(a, b, *taps), ABTimeline(timeline_a, timeline_b)

    def _keep_current(self) -> None:
        """An A/B restart is a new comparison; the main window keeps the runs worth returning to."""


class SideControls(QWidget):
    """Policy, page size, max pages and oracle of one side."""

    def __init__(self, name: str, changed):
        super().__init__()
        self.name = name
        self.policy = setting_input("policy", f"{name}: ")
        self.page_size = setting_input("page_size", f"{name}: ")
        self.max_pages = setting_input("max_pages", f"{name}: ")
        self.oracle = QCheckBox("oracle")
        self.oracle.setToolTip(f"{name}: compare with a full cache every step (KL against it; twice the work)")
        self.header = QLabel()
        self.header.setStyleSheet("font-weight: bold; font-size: 13px;")
        column = QVBoxLayout(self)  # the header above the inputs: beside them, two sides were 1394 px wide
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.header)
        row = QHBoxLayout()
        column.addLayout(row)
        for label, widget in (("policy", self.policy), ("page size", self.page_size), ("pages", self.max_pages)):
            row.addWidget(QLabel(label))
            row.addWidget(widget)
        row.addWidget(self.oracle)
        row.addStretch(1)
        self._base = SessionConfig()
        for signal in (self.policy.currentIndexChanged, self.page_size.valueChanged, self.max_pages.valueChanged,
                       self.oracle.toggled):
            signal.connect(lambda *_: changed(f"{name} changed"))

    def set_config(self, config: SessionConfig) -> None:
        self._base = config
        for widget in (self.policy, self.page_size, self.max_pages, self.oracle):
            widget.blockSignals(True)
        try:
            self.policy.setCurrentIndex(self.policy.findData(config.policy))
            self.page_size.setValue(config.page_size)
            self.max_pages.setValue(config.max_pages)
            self.oracle.setChecked(config.oracle)
        finally:
            for widget in (self.policy, self.page_size, self.max_pages, self.oracle):
                widget.blockSignals(False)
        self._update_header()

    def config(self) -> SessionConfig:
        policy = self.policy.currentData()
        params = dict(self._base.policy_params) if policy == self._base.policy else {}
        return replace(self._base, policy=policy, policy_params=params, page_size=self.page_size.value(),
                       max_pages=self.max_pages.value(), oracle=self.oracle.isChecked())

    def _update_header(self) -> None:
        c = self.config()
        self.header.setText(f"{self.name} · {c.policy} · {c.max_pages} × {c.page_size} = "
                            f"{c.ram_tokens} tokens")


class ABWindow(TimelineCursor, QMainWindow):
    def __init__(self, spec: ModelSpec, prompt: str, config_a: SessionConfig, config_b: SessionConfig,
                 title: str = "", parent=None):
        super().__init__(parent)
        self.setWindowTitle(f"pagevis — A/B{': ' + title if title else ''}")
        self.setWindowIcon(theme.icon("pagevis"))
        self.spec, self.prompt = spec, prompt
        self.runner = ABRunner(self)
        self.timeline: ABTimeline | None = None
        self.index = -1
        self.follow = True
        self._drawn_at = 0.0
        self._play_when_ready = False
        self._frame = QTimer(self, singleShot=True)
        self._frame.timeout.connect(self.redraw)
        self._build(config_a, config_b)
        self.runner.started.connect(self._started)
        self.runner.records.connect(self._arrived)
        self.runner.state_changed.connect(self._state_changed)
        add_close_keys(self)
        self.runner.failed.connect(lambda message, _: self.summary.setText(
            f"<span style='color:#ff7a7a'>{message}</span>"))

    # --- construction ----------------------------------------------------------------------------
    def _build(self, config_a: SessionConfig, config_b: SessionConfig) -> None:
        bar = QToolBar("A/B transport")
        bar.setMovable(False)
        self.addToolBar(bar)
        self.play_action = QAction(theme.icon("play"), "Play", self, shortcut=QKeySequence(Qt.Key_Space))
        self.step_action = QAction(theme.icon("step"), "Step", self, shortcut=QKeySequence(Qt.Key_Right))
        self.step_action.setToolTip("Next recorded step when scrubbed back; at the newest, decode one step of both (→)")
        self.reset_action = QAction(theme.icon("reset"), "Reset", self, shortcut=QKeySequence("Ctrl+R"))
        back = QAction("Back", self, shortcut=QKeySequence(Qt.Key_Left))
        for action in (self.play_action, self.step_action, self.reset_action):
            bar.addAction(action)
        self.addAction(back)
        self.play_action.triggered.connect(self.toggle_play)
        self.step_action.triggered.connect(self.step)
        self.reset_action.triggered.connect(lambda: self.restart("reset"))
        back.triggered.connect(lambda: self.scrub(self.index - 1))
        bar.addWidget(QLabel(" layer "))
        self.layer = _spin(0, 0, 0, "the layer both grids and texts show")
        self.layer.valueChanged.connect(lambda *_: self.redraw())
        bar.addWidget(self.layer)
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setFocusPolicy(Qt.NoFocus)
        self.slider.valueChanged.connect(lambda value: None if self._updating else self.scrub(value))
        self._updating = False
        bar.addWidget(self.slider)
        self.position = QLabel("no session")
        self.position.setMinimumWidth(120)
        bar.addWidget(self.position)

        self.sides = []
        columns = QSplitter(Qt.Horizontal)
        for name, config in (("A", config_a), ("B", config_b)):
            controls = SideControls(name, self.restart)
            controls.set_config(config)
            grid, text = PageGridView(), TextView()
            grid.legend.hide()  # one legend is enough: the main window explains the colours
            column = QSplitter(Qt.Vertical)
            top = QWidget()
            layout = QVBoxLayout(top)
            layout.setContentsMargins(2, 2, 2, 2)
            layout.addWidget(controls)
            layout.addWidget(grid, 1)
            column.addWidget(top)
            column.addWidget(text)
            column.setSizes([420, 220])
            columns.addWidget(column)
            self.sides.append((controls, grid, text))
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.RichText)
        self.plot_widget = pg.GraphicsLayoutWidget()
        self.plot = self.plot_widget.addPlot()
        theme.style_plot(self.plot, left="KL (nats)", bottom="step")
        self.plot.setMenuEnabled(False)
        s = theme.SERIES
        self.curves = {name: self.plot.plot(pen=pg.mkPen(color, width=1.6), name=label, connect="finite")
                       for name, color, label in (("kl_ab", s[0], "A‖B"), ("kl_a_full", s[1], "A‖full"),
                                                  ("kl_b_full", s[3], "B‖full"))}
        theme.set_title(self.plot, "  ".join(f"<span style='color:{c}'>━ {t}</span>" for c, t in
                                             ((s[0], "KL(A‖B)"), (s[1], "KL(full‖A)"), (s[3], "KL(full‖B)"))),
                        size="9pt", justify="left")
        self.cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=Qt.DashLine))
        self.plot.addItem(self.cursor, ignoreBounds=True)
        bottom = stacked(self.summary, (self.plot_widget, 1), margins=(4, 2, 4, 2))
        self.plot_widget.setMinimumHeight(120)  # the KL axis's label and ticks stay whole
        self.setCentralWidget(splitter(Qt.Vertical, columns, bottom, sizes=[600, 220]))
        self.resize(1280, 720)
        theme.grow_range(self.plot, 1, 1)
        self.redraw()

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
        except ConfigError as error:
            self.summary.setText(f"<span style='color:#ff7a7a'>Not restarted: {error}</span>")
            return
        for controls, _, _ in self.sides:
            controls._update_header()
        self.runner.configure(self.spec, self.prompt, configs, blocking=blocking)

    def _started(self, timeline: ABTimeline) -> None:
        self.timeline = timeline
        self.index, self.follow = -1, True
        self.layer.setMaximum(timeline.info.n_layers - 1)
        self.summary.setText("Press Space to decode both sessions in lockstep.")
        self.redraw()
        if self._play_when_ready:
            self._play_when_ready = False
            self.toggle_play()

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
        if state == "done" and self.runner.session is not None:
            self.summary.setText(self.summary.text() + f" — finished ({self.runner.session.stop_reason})")
        if state != "running":
            self.redraw()

    # --- drawing ---------------------------------------------------------------------------------
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
        steps = np.arange(count, dtype=np.float64)
        top = 0.0
        for name, curve in self.curves.items():
            series = timeline.series(name)
            curve.setData(steps, series, connect="finite")
            if np.isfinite(series).any():
                top = max(top, float(np.nanmax(series)))
        theme.grow_range(self.plot, max(count - 1, 1), max(top, 1.0), x_step=32)
        self.cursor.setValue(max(self.index, 0))
        self.summary.setText(self.describe())

    def describe(self) -> str:
        """One line: where the two texts diverge and how far apart the predictions are at this step."""
        timeline, index = self.timeline, self.index
        if timeline is None or index < 0:
            return ""
        a, b = timeline.a.record(index), timeline.b.record(index)
        parts = [f"step {index}: A {a.resident_tokens} resident, {a.evictions_total} evictions · "
                 f"B {b.resident_tokens} resident, {b.evictions_total} evictions"]
        kl = timeline.series("kl_ab")[index]
        if kl == kl:
            agree = timeline.series("top1_agree")[index]
            parts.append(f"KL(A‖B) {kl:.3f} nats, top-1 {'agrees' if agree else 'differs'}")
        for name, record in (("A", a), ("B", b)):
            if record.oracle is not None:
                parts.append(f"{name} vs full cache: KL {record.oracle.kl:.3f}")
        diverged = timeline.first_divergence()
        if diverged is None or diverged > index:
            parts.append("<span style='color:#7ee787'>the texts agree so far</span>")
        else:
            ra, rb = timeline.a.record(diverged), timeline.b.record(diverged)
            parts.append(f"<span style='color:#ffb020'>the texts diverge at step {diverged}: "
                         f"A {html.escape(repr(ra.next_text))} vs B {html.escape(repr(rb.next_text))}</span>")
        return " · ".join(parts)

    def closeEvent(self, event) -> None:
        self._frame.stop()
        self.runner.shutdown()
        super().closeEvent(event)

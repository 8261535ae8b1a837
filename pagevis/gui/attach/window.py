"""The attach window: a vLLM / SGLang engine's prefix cache, rebuilt from its KV events (`pagevis attach`).

Per engine (the selector at the top): the prefix forest (gui/widgets/prefix_forest.py: each block a box under its
parent, as wide as its tokens, coloured by medium; the newest stored, just removed, hot and shared ones marked;
hover for hash, parent, tokens, text, medium and when it was stored; click to see the whole prefix); store and
remove rates over time; resident blocks over time and per medium; block lifetimes; hot prefixes (stored again
soon after removal: thrashing); the engines and the blocks they hold in common (what a KV-aware router scores).
With --metrics, the engine's running / waiting requests, KV usage and prefix hit rate beside them. A recording
(--play) is scrubbed with the slider (one step = one live message) or played.

Threads (worker.py): a worker owns the subscriber or the playback, another lays out the forest; this window
only renders the frames they publish, pulled by a 33 ms timer: its views (views.py) draw them in `show_state`. Decode errors are counted and the last one
shown; nothing a stream sends raises here.

`launch(sources=, playback=, detokenizer=, metrics_url=, record=)` is what `pagevis attach` calls.
"""

from __future__ import annotations

import os
import sys
import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QMainWindow, QPushButton, QSlider, QSplitter,
                               QTabWidget, QVBoxLayout, QWidget)

from pagevis.gui.teardown import windows_deleted_on_return
from pagevis.gui.widgets.windows import add_close_keys
from pagevis.gui.widgets import theme
from pagevis.viewmodel.attach_forest import (
    hot_rows,
    metric_series,
)
from pagevis.gui.attach.worker import (
    FleetWorker,
    ForestWorker,
    GcFreezer,
    LiveSource,
    MetricsWorker,
    PlaybackSource,
)
from pagevis.viewmodel.forest_layout import DEFAULT_BUDGET
from pagevis.gui.attach.views import EnginePlots, EnginesTable, Fleet, ForestPanel, HotTable
from pagevis.gui.attach.explain_pane import ExplainPane, add_overlay, give_room, run_explain

REFRESH_MS = 33  # at most ~30 redraws a second
TABLE_S = 0.25  # tables refresh at most 4 times a second
PLOT_S = 0.1  # live: plots redraw at most 10 times a second (a scrub redraws at once)
LIVE_FOREST_S = 0.25  # live: a new forest at most 4 times a second (its paint is the window's largest)
SPEEDS = (1, 10, 100, 1000, 10000)  # playback: live messages per second
MAX_PREFIX_BLOCKS = 4096  # walked up from a selected block for its prefix text


class AttachWindow(QMainWindow):
    def __init__(self, source, detokenizer=None, metrics_url: str | None = None, recorder=None,
                 budget: int = DEFAULT_BUDGET, parent=None, tokenizer=None):
        super().__init__(parent)
        theme.configure_pyqtgraph()
        self.source, self.detokenizer, self.recorder = source, detokenizer, recorder
        self.tokenizer = tokenizer  # attach.tokens.PromptTokenizer: the Explain tab encodes text with it
        self.forest_worker = ForestWorker(detokenizer, budget, LIVE_FOREST_S if source.live else 0.0)
        self.freezer = GcFreezer()
        self.fleet_worker = FleetWorker(source, self.forest_worker, self.freezer)
        self.metrics_worker = MetricsWorker(metrics_url) if metrics_url else None
        self.metrics_t0 = time.monotonic()
        self.frame = None  # the FleetFrame shown
        self.forest_frame = None  # the ForestFrame shown
        self.frames = 0  # redraws (for the bench)
        self.forest_frames = 0  # forests shown
        self.forest_shown: list = []  # callables(ForestFrame), called as each forest is shown (for the bench)
        self.selected_key = None  # (medium, group, hash) clicked
        self._table_at = 0.0
        self._metrics_count = -1
        self._playing_since: float | None = None
        self._play_from = 0
        self._plotted = None
        self._display_error = ""
        self._plots_at = 0.0
        self._closed = False
        self.setWindowTitle("pagevis attach — " + ("recording" if not source.live else "live KV events"))
        self._build(budget)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.resize(1600, 1000)
        add_close_keys(self)

    # --- building ---------------------------------------------------------------------------------------------
    def _build(self, budget: int) -> None:
        self.engine_box = QComboBox()
        self.engine_box.setToolTip("the engine (endpoint, data parallel rank) whose cache the window shows")
        self.engine_box.setMinimumContentsLength(28)
        self.engine_box.currentIndexChanged.connect(self.select_engine)
        self.status = QLabel("attaching…" if self.source.live else "")
        self.status.setTextFormat(Qt.RichText)
        self.errors = QLabel("")
        self.errors.setObjectName("inlineError")
        self.errors.setWordWrap(True)
        top = QHBoxLayout()
        top.addWidget(QLabel("engine"))
        top.addWidget(self.engine_box)
        top.addWidget(self.status, 1)
        self.scrub_row = self._build_scrub()
        self.forest_panel = left = ForestPanel(budget)
        self.forest, self.show_all, self.details = left.forest, left.show_all, left.details
        self.forest.clicked.connect(self._clicked)
        self.overlay = add_overlay(self.forest)
        self.forest.focus_requested.connect(self.focus)
        self.show_all.clicked.connect(lambda: self.focus(-1))
        self.plots = EnginePlots(with_metrics=self.metrics_worker is not None)
        self.body = self._build_body(left)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addLayout(top)
        layout.addWidget(self.scrub_row)
        layout.addWidget(self.errors)
        layout.addWidget(self.body, 1)
        self.setCentralWidget(central)

    def _build_scrub(self) -> QWidget:
        """A recording's play button, speed, slider and position (hidden when live)."""
        self.play_button = QPushButton("Play")
        self.play_button.setCheckable(True)
        self.play_button.toggled.connect(self._play_toggled)
        self.speed = QComboBox()
        for speed in SPEEDS:
            self.speed.addItem(f"{speed:,} msg/s", speed)
        self.speed.setCurrentIndex(1)
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setRange(0, self.source.length or 0)
        self.slider.setToolTip("scrub the recording: the state after this many live messages")
        self.slider.valueChanged.connect(self.scrub)
        self.position_label = QLabel("")
        self.position_label.setMinimumWidth(240)
        scrub = QHBoxLayout()
        for widget in (self.play_button, self.speed):
            scrub.addWidget(widget)
        scrub.addWidget(self.slider, 1)
        scrub.addWidget(self.position_label)
        scrub_row = QWidget()
        scrub_row.setLayout(scrub)
        scrub_row.setVisible(not self.source.live)
        return scrub_row

    def _build_tables(self) -> QTabWidget:
        self.hot_table = HotTable()
        self.engines_table = EnginesTable()
        self.explain_pane = ExplainPane(self.tokenizer)
        self.explain_pane.button.clicked.connect(self.run_explain)
        # tabs, each table the pane's whole width: side by side, at 1280 × 720 both hid columns past a scroll bar
        tables = QTabWidget()
        for name, title, table in (("Hot prefixes", "stored again soon after removal", self.hot_table),
                                   ("Engines", "GPU blocks held in common (a KV-aware router's overlap)",
                                    self.engines_table),
                                   ("Explain", "a prompt against every engine's cache: hits, the first miss and "
                                               "why, the engine it should go to", self.explain_pane)):
            tables.addTab(table, name)
            tables.setTabToolTip(tables.count() - 1, f"{name}: {title}")
        return tables

    def _build_body(self, left: QWidget) -> QSplitter:
        self.right = right = QSplitter(Qt.Vertical)
        right.addWidget(self.plots)
        tables = self._build_tables()
        tables.currentChanged.connect(self._tab_changed)
        right.addWidget(tables)
        right.setStretchFactor(0, 3)
        right.setStretchFactor(1, 1)
        right.setSizes([700, 260])
        body = QSplitter(Qt.Horizontal)
        body.addWidget(left)
        body.addWidget(right)
        body.setStretchFactor(0, 1)  # halves: the plots' titles need the width (the tables held it before)
        body.setStretchFactor(1, 1)
        return body

    def _tab_changed(self, index: int) -> None:
        give_room(self.right, self.right.widget(1).widget(index) is self.explain_pane)

    # --- running ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.freezer.freeze()  # the process's objects as they are now: never traversed by a collection again
        self.forest_worker.start()
        self.fleet_worker.start()
        if self.metrics_worker is not None:
            self.metrics_worker.start()
        self.timer.start()

    def threads(self) -> list:
        return [t for t in (self.fleet_worker, self.forest_worker, self.metrics_worker) if t is not None]

    def stop(self) -> bool:
        """Stop the timer and every worker (the subscriber's sockets close on its own thread); close the
        recording. True if every thread has finished."""
        self.timer.stop()
        self.play_button.setChecked(False)
        for worker in self.threads():
            worker.requestInterruption()
        finished = all([worker.stop() for worker in self.threads()])
        if finished:
            self.freezer.release()
        if self.recorder is not None and not self.fleet_worker.isRunning():
            self.recorder.close()
            self.recorder = None
        return finished

    def closeEvent(self, event) -> None:
        if not self._closed:
            self._closed = True
            self.stop()
        super().closeEvent(event)

    def scrub(self, position: int) -> None:
        """Show the recording's state after `position` live messages."""
        if self.source.live:
            return
        position = max(0, min(int(position), self.source.length))
        self.source.target = position
        if self.slider.value() != position:
            self.slider.blockSignals(True)
            self.slider.setValue(position)
            self.slider.blockSignals(False)

    def select_engine(self, index: int) -> None:
        if index < 0 or index == self.fleet_worker.selected:
            return
        self.fleet_worker.selected = index
        self.forest_worker.forget()
        self.selected_key = None
        self.overlay.show(self.forest, None)
        self.explain_pane.show_detail(index, self.engine_box.itemText(index))

    def _play_toggled(self, on: bool) -> None:
        if on and self.source.target >= self.source.length:
            self.scrub(0)
        self._playing_since = time.monotonic() if on else None
        self._play_from = self.source.target
        self.play_button.setText("Pause" if on else "Play")

    def _advance_play(self) -> None:
        if self._playing_since is None:
            return
        speed = self.speed.currentData() or 10
        target = self._play_from + int((time.monotonic() - self._playing_since) * speed)
        self.scrub(target)
        if target >= self.source.length:
            self.play_button.setChecked(False)

    # --- drawing ----------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Show the newest frames the workers made (a no-op for the ones already shown). Whatever goes wrong
        while drawing is shown in the error line, never raised out of the timer."""
        self.freezer.tick()  # its periodic collection on this (the GUI) thread: never a Qt object on a worker's
        try:
            self._refresh()
        except Exception as error:  # noqa: BLE001 - a display bug must not take the window down
            self._display_error = f"display: {type(error).__name__}: {error}"[:300]
            self._show_errors()

    def _refresh(self) -> None:
        self._advance_play()
        frame = self.fleet_worker.latest
        changed = False
        if frame is not None and frame is not self.frame:
            self.frame = frame
            self._show_fleet(frame)
            changed = True
        forest = self.forest_worker.latest
        if forest is not None and forest is not self.forest_frame:
            self.forest_frame = forest
            self._show_forest(forest)
            changed = True
        if self.metrics_worker is not None:
            changed |= self._show_metrics()
        self._show_errors()
        if changed:
            self.frames += 1

    def _show_fleet(self, frame) -> None:
        names = [line.name for line in frame.engines]
        if [self.engine_box.itemText(i) for i in range(self.engine_box.count())] != names:
            self.engine_box.blockSignals(True)
            self.engine_box.clear()
            self.engine_box.addItems(names)
            self.engine_box.setCurrentIndex(frame.selected)
            self.engine_box.blockSignals(False)
        engine = frame.engine
        if not frame.started and self.source.live:
            self._set_text(self.status, "attaching: rebuilding each engine's state from its replay endpoint…")
        if engine is not None:
            self._set_text(self.status, self._status_text(frame))
            c = engine.counters
            key = (engine.name, c.epoch, c.batches, c.decode_errors, engine.lifetimes_total, id(self.source.fleet))
            now = time.monotonic()
            if key != self._plotted and (not self.source.live or now - self._plots_at >= PLOT_S):
                self._plotted, self._plots_at = key, now
                self.plots.show_state(engine)
        if frame.length is not None:
            self.slider.setRange(0, frame.length)
            seq = engine.counters.last_seq if engine is not None else None
            self._set_text(self.position_label, f"message {frame.position:,} / {frame.length:,}"
                           + (f" · seq {seq}" if seq is not None else ""))
        now = time.monotonic()
        if now - self._table_at >= TABLE_S or not self.source.live:
            self._table_at = now
            forest = self.forest_frame
            self.engines_table.show_state(Fleet(frame, forest.overlap if forest is not None else None))
            if engine is not None:
                self.hot_table.show_state(hot_rows(engine, self._forest_engine(), self.detokenizer))

    def _status_text(self, frame) -> str:
        engine = frame.engine
        c = engine.counters
        parts = [f"<b>{'live' if self.source.live else 'recording'}</b>",
                 f"{len(frame.engines)} engine{'s' if len(frame.engines) != 1 else ''}",
                 f"batches {c.batches:,}" + (f" (last seq {c.last_seq}" if c.last_seq is not None else " (")
                 + f"{', ' if c.last_seq is not None else ''}{c.replayed_batches:,} replayed)",
                 f"epoch {c.epoch}"]
        if c.history_from_seq is not None or c.history_missing is not None:
            if c.history_batches == 0:
                parts.append("replay buffer empty")
            else:
                whole = "the whole history" if c.history_missing == 0 else (
                    f"{c.history_missing} earlier batches lost" if c.history_missing else "history before unknown")
                parts.append(f"rebuilt from {c.history_batches:,} replayed batches ({whole})")
        parts.append(f"{frame.shared_blocks:,} GPU blocks in 2+ engines")
        return " · ".join(parts)

    def _show_errors(self) -> None:
        frame = self.frame
        parts = []
        if frame is not None:
            total = sum(line.counters.decode_errors for line in frame.engines)
            if total:
                last = next((line for line in frame.engines if line.counters.last_decode_error), None)
                parts.append(f"decode errors: {total:,}" + (f" (last, {last.name}: {last.counters.last_decode_error})"
                                                             if last else ""))
            lost = sum(line.counters.gaps_unrecovered for line in frame.engines)
            if lost:
                parts.append(f"{lost} gaps replay could not fill "
                             f"({sum(line.counters.missing_batches for line in frame.engines):,} batches missing)")
            dropped = sum(line.counters.dropped_stores for line in frame.engines)
            if dropped:
                parts.append(f"{dropped:,} stores dropped (max blocks per engine reached)")
            if frame.error:
                parts.append(f"worker: {frame.error}")
        if self.forest_worker.error:
            parts.append(self.forest_worker.error)
        if self.metrics_worker is not None and self.metrics_worker.error:
            parts.append(f"--metrics: {self.metrics_worker.error}")
        if self._display_error:
            parts.append(self._display_error)
        self._set_text(self.errors, " · ".join(parts))
        self.errors.setVisible(bool(parts))

    @staticmethod
    def _set_text(label: QLabel, text: str) -> None:
        if label.text() != text:
            label.setText(text)

    def _forest_engine(self):
        frame = self.forest_frame
        return frame.forest if frame is not None else None

    def _forest_row(self, row: int) -> int:
        """The whole forest's row of a row of the drawing (they differ while a subtree is focused)."""
        frame = self.forest_frame
        if frame is None or frame.shown_rows is None or row < 0:
            return row
        return int(frame.shown_rows[row])

    def focus(self, row: int) -> None:
        """Show only the subtree of the drawing's `row` (re-laid out with the whole budget); -1: everything."""
        key = self.forest.rows.key(row) if row >= 0 else None
        self.forest_worker.focus = key
        self.show_all.setVisible(key is not None)
        self.forest.summary.setText(self.forest.summary.text() + theme.muted(" · laying out…"))

    def run_explain(self) -> None:
        """Explain the Explain tab's request against every engine now, rank them, outline the selected engine's
        path (explain_pane.run)."""
        run_explain(self.explain_pane, self.source.fleet, self.detokenizer)
        self._show_overlay()

    def _show_overlay(self) -> None:
        result, selected = self.explain_pane.result, self.fleet_worker.selected
        engines = result["engines"] if result is not None else []
        self.overlay.show(self.forest, engines[selected] if 0 <= selected < len(engines) else None)
        self.explain_pane.show_detail(selected, self.engine_box.currentText())

    def _show_forest(self, frame) -> None:
        self.forest_panel.show_state(frame)
        if self.explain_pane.result is not None:
            self.run_explain()  # the pools changed (or a scrub moved): the same request against them now
        if self.forest_worker.focus is not None:  # a subtree asked for and not laid out yet
            self.show_all.show()
        self.forest_frames += 1
        for call in self.forest_shown:
            call(frame)
        if self.selected_key is not None:
            medium, group, block_hash = self.selected_key
            self._show_details(frame.forest.block_row(block_hash, medium, group))

    def _clicked(self, row: int) -> None:
        """A click on the drawing's `row`: its details, and its whole prefix."""
        if row < 0:
            return
        self.selected_key = self.forest.rows.key(row)
        self._show_details(self._forest_row(row))

    def _show_details(self, row: int) -> None:
        """The details of the whole forest's `row` (-1: the selected block is gone)."""
        forest = self._forest_engine()
        if row < 0 or forest is None:
            self.details.setPlainText("(the selected block is not resident any more)")
            return
        rows = forest.rows
        chain, seen = [], set()
        at = row
        while at >= 0 and at not in seen and len(chain) < MAX_PREFIX_BLOCKS:
            seen.add(at)
            chain.append(at)
            at = int(rows.parent[at])
        chain.reverse()
        lines = [rows.describe(row), ""]
        ids = [t for r in chain for t in forest.tokens(r).tolist()]
        lines.append(f"its prefix: {len(chain)} blocks, {len(ids):,} tokens")
        if self.detokenizer is not None and ids:
            try:
                lines.append(self.detokenizer(ids[-8192:]))
            except Exception as error:  # noqa: BLE001 - see attach_model._Texts._text
                lines.append(f"(text unavailable: {type(error).__name__})")
        else:
            lines.append(" ".join(map(str, ids[-512:])) + "  (give --tokenizer for text)")
        self.details.setPlainText("\n".join(lines))

    def _show_metrics(self) -> bool:
        worker = self.metrics_worker
        if worker.scrapes == self._metrics_count:
            return False
        self._metrics_count = worker.scrapes
        self.plots.metrics.show_state(metric_series(worker.samples(), self.metrics_t0))
        return True


def open_window(sources=(), playback=None, detokenizer=None, metrics_url=None, record=None,
                budget: int = DEFAULT_BUDGET, tokenizer=None) -> AttachWindow:
    """The window on endpoints (`sources`, pagevis.attach.subscriber.Source) or a `playback`, not started."""
    recorder = None
    if playback is not None:
        source = PlaybackSource(playback)
        source.target = len(playback)  # a recording opens at its end; scrub back from there
    else:
        if record:
            from pagevis.attach.recording import Recorder

            topic = next((s.topic for s in sources if s.topic), None)
            recorder = Recorder(record, [s.endpoint for s in sources],
                                {"replays": [s.replay for s in sources], "topic": topic})
        source = LiveSource(list(sources), recorder)
    window = AttachWindow(source, detokenizer, metrics_url, recorder, budget, tokenizer=tokenizer)
    if playback is not None:
        window.scrub(len(playback))
    return window


@windows_deleted_on_return
def launch(sources=(), playback=None, detokenizer=None, metrics_url=None, record=None, tokenizer=None) -> int:
    """Open the attach window (QApplication created here) and run until it closes; the exit code."""
    from pagevis import platform_check
    from pagevis.gui import _application

    verdict = platform_check.check()
    if not verdict.ok:
        print(verdict.message(), file=sys.stderr)
        return platform_check.EXIT_STATUS
    app = _application()
    window = open_window(sources, playback, detokenizer, metrics_url, record, tokenizer=tokenizer)
    window.show()
    window.start()
    code = app.exec()
    window.stop()
    return code


def wait_for_position(window: AttachWindow, position: int, timeout_s: float = 30.0) -> bool:
    """Let the window run until both its fleet frame and its forest show playback `position`."""
    from PySide6.QtWidgets import QApplication

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        QApplication.processEvents()
        forest, frame = window.forest_frame, window.frame
        if (forest is not None and forest.position == position and frame is not None
                and frame.position == position):
            return True
        time.sleep(0.005)
    return False


def screenshot(path: str, playback, detokenizer=None, position: int | None = None, size=(1600, 1000),
               select=None, timeout_s: float = 30.0) -> bool:
    """Open the window on `playback` at `position` (default: the end), wait for its frames, save a PNG."""
    from pagevis.gui import _application

    if "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    app = _application()
    window = open_window(playback=playback, detokenizer=detokenizer)
    window.resize(*size)
    window.show()
    window.start()
    target = len(playback) if position is None else position
    for at in (max(target - 1, 0), target):  # one step before: the marks show what the last message changed
        window.scrub(at)
        wait_for_position(window, at, timeout_s)
    if select is not None:
        row = window.forest.row_of(select)
        if row >= 0:
            window._clicked(row)
    for _ in range(5):
        app.processEvents()
        time.sleep(0.02)
    if app.platformName() == "xcb":  # the pixels as the X server holds them
        from pagevis.gui import _grab_from_screen

        image = _grab_from_screen(app, window)
    else:
        image = window.grab()
    ok = image.save(path)
    window.close()
    return ok

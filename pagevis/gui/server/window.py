"""The Server window: the one engine serving arriving requests, live — continuous batching, the prefix cache
and preemption, and (A/B) what prefix caching or paging buys, measured on the same seeded arrivals.

The window drives `ServerRun` (or `ServerPair` for an A/B) through the one run loop in a worker thread
(superqt): the worker steps, and at most every 1/30 s hands the UI thread the ServerSteps since the last hand-
over plus a snapshot of each side (its request rows and prefix forest, taken between steps on the worker's
thread). The UI thread only renders those: the pool and queues of the newest step, the plots of every step,
the request timelines and the forest of the snapshot. Nothing here touches the engine while the worker runs;
the live controls (arrival rate, max running requests) are plain values the worker reads between steps.
"""

from __future__ import annotations

import time
from dataclasses import replace

from PySide6.QtCore import QThreadPool, QTimer, Qt
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QGridLayout, QHBoxLayout, QLabel, QPushButton, QSizePolicy,
                               QSplitter, QTabWidget, QVBoxLayout, QWidget)
from superqt.utils import create_worker

from pagevis.engine import RunControl
from pagevis.simserver.run import COMPARES, ServerPair, ServerRun, side_configs
from pagevis.simserver.workload import WORKLOADS, ArrivalSchedule
from pagevis.presets import SERVER_PRESETS, ServerPreset
from pagevis.gui.widgets import theme
from pagevis.gui.widgets.setting_inputs import setting_input
from pagevis.gui.session.runner import WorkerFailure, run_control, worker_steps
from pagevis.gui.sequences.window import _spin
from pagevis.gui.server.forest import ServerForest
from pagevis.gui.server.plots import SIDE_COLORS, ServerPlots
from pagevis.viewmodel.server_series import SideSeries
from pagevis.gui.server.pool import BatchBars, QueuesView, legend_html, pool_cells, request_pool_grid
from pagevis.gui.server.timeline import RequestTimeline
from pagevis.gui.widgets.windows import add_close_keys, place_beside

FRAME = 1 / 30  # the UI redraws at most this often
SLOW = 0.5  # seconds between redraws of the plots, forests, timelines and the table while running


class SidePanel(QWidget):
    """One side: its pool, queues, batch composition, prefix forest and request timeline."""

    def __init__(self, side: str, label: str):
        super().__init__()
        self.side = side
        self.title = QLabel(f"<b style='color:{SIDE_COLORS[side]}'>{side}</b> {label}")
        self.title.setWordWrap(True)
        self.pool = request_pool_grid()
        self.queues = QueuesView()
        self.batch = BatchBars()
        self.forest = ServerForest()
        self.timeline = RequestTimeline()
        top = QWidget()
        column = QVBoxLayout(top)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.title)
        column.addWidget(self.pool, 3)
        column.addWidget(self.queues)
        column.addWidget(self.batch, 1)
        # the forest and the request timeline share a place, as tabs: stacked under the pool, the five parts
        # of a side left each plot a line high at 1280 × 720
        self.tabs = QTabWidget()
        self.tabs.addTab(self.timeline, "requests over time")
        self.tabs.addTab(self.forest, "prefix forest")
        split = QSplitter(Qt.Vertical)
        split.addWidget(top)
        split.addWidget(self.tabs)
        split.setChildrenCollapsible(False)
        split.setSizes([480, 360])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(split)
        self.step = None

    def show_state(self, step, series: SideSeries) -> None:
        """The newest step's pool and queues, and the batches of the newest steps."""
        self.step = step
        if step.pool is not None:
            self.pool.show_state(pool_cells(step))
        self.queues.show_state(step)
        self.batch.show_state(series)


class ServerWindow(QWidget):
    def __init__(self, model, preset: ServerPreset = SERVER_PRESETS[0], parent=None, model_label: str = "",
                 realtime: bool = True, autorun: bool = False):
        super().__init__(parent, Qt.Window)
        self.model, self.preset, self.realtime = model, preset, realtime
        name = preset.name.removeprefix("Server: ")  # the presets' names say it already
        self.setWindowTitle(f"pagevis — server: {name}" + (f" ({model_label})" if model_label else ""))
        self.sides: list[ServerRun] = []
        self.stepper = None
        self.schedule: ArrivalSchedule | None = None
        self.series: dict[str, SideSeries] = {}
        self.snapshots: dict[str, object] = {}
        self.latest: dict[str, object] = {}  # side -> newest ServerStep
        self.panels: dict[str, SidePanel] = {}
        self.worker = None
        self.control: RunControl | None = None
        self.frames = 0
        self._dirty = False
        self._last_draw = self._last_slow = 0.0
        self._jobs: list = []
        self.closed = False
        self._build_controls(preset)
        self.plots = ServerPlots()
        self.summary = QLabel()
        self.summary.setTextFormat(Qt.RichText)
        self.summary.setWordWrap(True)
        self.summary.setFixedHeight(self.summary.fontMetrics().lineSpacing() * 12 + 8)  # the table never moves
        self.legend = QLabel(legend_html())
        self.legend.setWordWrap(True)
        self.status = QLabel("Start builds the server; Run serves the arriving requests.")
        self.status.setFixedHeight(self.status.fontMetrics().lineSpacing() + 4)
        self.status.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        right = QWidget()
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        self.numbers = QLabel()
        self.numbers.setTextFormat(Qt.RichText)
        self.numbers.setFixedHeight(self.numbers.fontMetrics().lineSpacing() * 3 + 4)
        self.numbers.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)  # long text is clipped, not a minimum
        column.addWidget(self.summary)
        column.addWidget(self.numbers)
        column.addWidget(self.plots, 1)
        self.sides_box = QWidget()
        self.sides_layout = QHBoxLayout(self.sides_box)
        self.sides_layout.setContentsMargins(0, 0, 0, 0)
        self.body = QSplitter(Qt.Horizontal)
        self.body.addWidget(self.sides_box)
        self.body.addWidget(right)
        layout = QVBoxLayout(self)
        layout.addLayout(self.controls)
        layout.addWidget(self.body, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.status)
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setSingleShot(True)
        self.redraw_timer.timeout.connect(self._frame)
        self.resize(1600, 1000)
        add_close_keys(self)
        self.start()
        if autorun:  # one click (View ▸ Server, --server-demo) shows the server at work
            QTimer.singleShot(0, lambda: self.run_button.setChecked(True))

    # --- controls ----------------------------------------------------------------------------------------
    def _build_controls(self, preset: ServerPreset) -> None:
        wl, server = preset.workload, preset.server
        self.workload = QComboBox()
        for kind, description in WORKLOADS.items():
            self.workload.addItem(kind, kind)
            self.workload.setItemData(self.workload.count() - 1, description, Qt.ToolTipRole)
        self.workload.setCurrentIndex(list(WORKLOADS).index(wl.kind))
        self.rate = QDoubleSpinBox()
        self.rate.setRange(0.5, 6000)
        self.rate.setDecimals(1)
        self.rate.setValue(wl.rate_per_min)
        self.rate.setSuffix(" /min")
        self.rate.setToolTip("arriving requests per minute of server time (Poisson); applies from the next arrival")
        self.n_requests = _spin(1, 10_000, wl.n_requests, "requests in the workload (users, for returning users)")
        self.seed = _spin(0, 2**31 - 1, wl.seed, "seed of the arrivals and of every request's sampling")
        self.max_running = setting_input("max_seqs", "from the next step: ", server.max_seqs)
        self.pool_pages = setting_input("pool_pages", "on Start: ", server.pool_pages)
        self.compare = QComboBox()
        for key, text in COMPARES.items():
            self.compare.addItem(text, key)
        self.compare.setCurrentIndex(list(COMPARES).index(preset.compare))
        self.start_button = QPushButton("Start")
        self.start_button.setToolTip("build the server(s) from these settings, with nothing served yet")
        self.run_button = QPushButton("Run")
        self.run_button.setCheckable(True)
        self.step_button = QPushButton("Step")
        self.controls = QGridLayout()
        row = [("workload", self.workload), ("arrivals", self.rate), ("requests", self.n_requests),
               ("seed", self.seed), ("max running", self.max_running), ("pool pages", self.pool_pages),
               ("compare", self.compare)]
        per_row = 4  # two rows: one row was 1 470 px wide, more than a 1280-px screen
        for i, (label, widget) in enumerate(row):
            self.controls.addWidget(QLabel(label), i // per_row, 2 * (i % per_row))
            self.controls.addWidget(widget, i // per_row, 2 * (i % per_row) + 1)
        for box in (self.seed, self.n_requests, self.pool_pages):
            box.setMaximumWidth(90)  # a spin box sizes itself for its largest value (2^31 for the seed)
        buttons = QHBoxLayout()
        for button in (self.start_button, self.run_button, self.step_button):
            buttons.addWidget(button)
        self.controls.addLayout(buttons, 1, 2 * (len(row) % per_row), 1, 2)
        self.controls.setColumnStretch(2 * per_row, 1)
        self.start_button.clicked.connect(self.start)
        self.run_button.toggled.connect(lambda on: self.play() if on else self.pause())
        self.step_button.clicked.connect(lambda: self.run_steps(1))
        self.rate.valueChanged.connect(self._rate_changed)
        self.max_running.valueChanged.connect(self._max_running_changed)

    def _rate_changed(self, value: float) -> None:
        if self.schedule is not None:
            self.schedule.set_rate(value)

    def _max_running_changed(self, value: int) -> None:
        for side in self.sides:
            side.set_max_running(value)

    def settings(self) -> ServerPreset:
        """The preset as the controls now say."""
        p = self.preset
        workload = replace(p.workload, kind=self.workload.currentData(), rate_per_min=self.rate.value(),
                           n_requests=self.n_requests.value(), seed=self.seed.value())
        server = replace(p.server, max_seqs=self.max_running.value(), pool_pages=self.pool_pages.value(),
                         realtime=self.realtime if p.server.step_seconds is None else False)
        return replace(p, workload=workload, server=server, compare=self.compare.currentData())

    # --- the server --------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.worker is not None

    def start(self) -> bool:
        """(Re)build the server(s) from the controls: a new schedule of arrivals, empty pools."""
        if self.busy:
            self.status.setText("pause first (the worker is stepping)")
            return False
        self._close_sides()
        self._jobs = []  # a frame's jobs still to run would draw the panels about to go
        chosen = self.settings()
        try:
            self.schedule = ArrivalSchedule(chosen.workload, self.model)
            session = chosen.session_config()
            configs = side_configs(chosen.server, chosen.compare)
            self.sides = [ServerRun(self.model, session, config, self.schedule, side)
                          for side, config in zip("AB", configs)]
        except (ValueError, MemoryError) as error:  # ConfigError is a ValueError
            self.status.setText(f"could not build the server: {error}")
            self.sides, self.stepper = [], None
            return False
        self.stepper = self.sides[0] if len(self.sides) == 1 else ServerPair(*self.sides)
        self.series = {side.side: SideSeries(side.side) for side in self.sides}
        self.snapshots, self.latest = {}, {}
        for panel in self.panels.values():
            panel.setParent(None)
            panel.deleteLater()
        self.panels = {side.side: SidePanel(side.side, side.config.label) for side in self.sides}
        for panel in self.panels.values():
            self.sides_layout.addWidget(panel)
        self.body.setSizes([560 * len(self.sides), 640])
        self._plots()
        self._summary()
        wl = chosen.workload
        self.status.setText(f"{wl.n_requests} requests ({wl.kind}) at {wl.rate_per_min:g}/min, seed {wl.seed}; "
                            f"pool of {chosen.server.pool_pages} pages of {chosen.page_size} tokens per layer, "
                            f"up to {chosen.server.max_seqs} running. Run or Step.")
        return True

    def _close_sides(self) -> None:
        for side in self.sides:
            side.close()
        self.sides, self.stepper = [], None

    def play(self) -> None:
        self.run_steps(None)

    def pause(self) -> None:
        if self.control is not None:
            self.control.stop = True

    def run_steps(self, budget: int | None) -> None:
        """Step in the worker thread: `budget` steps, or until paused or every request is served."""
        if self.busy or (self.stepper is None and not self.start()):
            return
        if self.stepper.done:
            self._finished_all()
            return
        self.control = run_control(budget)
        self.worker = create_worker(worker_steps, self.stepper, self.control, FRAME, self._handover,
                                    _start_thread=False, _ignore_errors=True)
        self.worker.yielded.connect(self._received)
        self.worker.finished.connect(self._worker_finished)
        self.worker.start()

    def step_blocking(self, n: int, every_step: bool = True) -> int:
        """Run n steps on this thread, rendering after each (tests, screenshots); the steps taken."""
        if self.busy or (self.stepper is None and not self.start()):
            return 0
        taken = 0
        for item in worker_steps(self.stepper, RunControl(budget=n), 0.0 if every_step else FRAME, self._handover):
            if not isinstance(item, WorkerFailure):
                taken += len(item[0])
            self._received(item)
            if every_step:
                self.redraw()
        self.redraw()
        return taken

    def _handover(self, server_steps: list) -> tuple:
        """What the worker hands the UI thread: the steps, and each side's snapshot taken after them."""
        return server_steps, tuple(side.snapshot() for side in self.sides)

    def _received(self, item) -> None:
        if isinstance(item, WorkerFailure):
            self.pause()
            self.status.setText(f"step failed: {type(item.error).__name__}: {item.error}")
            return
        server_steps, snapshots = item
        for step in server_steps:
            self.series[step.side].add(step)
            self.latest[step.side] = step
        for snapshot in snapshots:
            self.snapshots[snapshot.side] = snapshot
        self.request_redraw()

    def _worker_finished(self) -> None:
        self.worker, self.control = None, None
        self.request_redraw()  # the last frame draws everything (no worker: every job is due)
        self.run_button.blockSignals(True)
        self.run_button.setChecked(False)
        self.run_button.blockSignals(False)
        if self.stepper is not None and self.stepper.done:
            self._finished_all()

    def _finished_all(self) -> None:
        self.run_button.setChecked(False)
        self._status_line()

    # --- drawing -----------------------------------------------------------------------------------------
    # While the worker runs, a frame is a list of small jobs, each run in its own turn of the event loop (Qt
    # paints between them), so that no turn holds the UI thread long; the pool, queues and batch of each side
    # are drawn every frame, the plots, forests, timelines and the table at most every SLOW seconds.
    @property
    def drawing(self) -> bool:
        """A frame is due or half drawn."""
        return self._dirty or bool(self._jobs) or self.redraw_timer.isActive()

    def request_redraw(self) -> None:
        if self.closed:
            return
        self._dirty = True
        if not self.redraw_timer.isActive() and not self._jobs:
            wait = max(0.0, FRAME - (time.perf_counter() - self._last_draw))
            self.redraw_timer.start(int(wait * 1000))

    def _frame(self) -> None:
        """The redraw timer: this frame's jobs, then one per turn of the event loop."""
        self._last_draw = now = time.perf_counter()
        if not self._dirty:
            return
        self._dirty = False
        self.frames += 1
        slow = now - self._last_slow >= SLOW or self.worker is None
        self._jobs = self._frame_jobs(slow)
        if slow:
            self._last_slow = now
        self._next_job()

    def _next_job(self) -> None:
        if self.closed:
            return
        if self._jobs:
            self._jobs.pop(0)()
        if self._jobs:
            QTimer.singleShot(0, self._next_job)
        elif self._dirty:
            self.request_redraw()

    def _frame_jobs(self, slow: bool) -> list:
        def fast() -> None:  # every frame: each side's pool, queues and batch
            for side, panel in self.panels.items():
                if side in self.latest:
                    panel.show_state(self.latest[side], self.series[side])

        jobs = [fast]
        if slow:
            for side, panel in self.panels.items():
                if side in self.snapshots:
                    jobs.append(lambda p=panel, s=side: p.forest.show_state(self.snapshots[s]))
                    jobs.append(lambda p=panel, s=side: p.timeline.show_state(self.snapshots[s]))
            jobs += [self._plots, self._summary, self._status_line]
        return jobs

    def redraw(self) -> None:
        """Everything at once, now (tests, screenshots)."""
        self._jobs = []
        self._last_draw = self._last_slow = time.perf_counter()
        self._dirty = False
        self.frames += 1
        for job in self._frame_jobs(slow=True):
            job()

    def _plots(self) -> None:
        self.plots.show_state(self.series)
        self.numbers.setText(self.plots.numbers_html())

    def _status_line(self) -> None:
        if self.latest:
            newest = max(self.latest.values(), key=lambda s: s.t1)
            done = self.stepper is not None and self.stepper.done
            self.status.setText(f"server time {newest.t1:.1f} s · " + " · ".join(
                f"{s.side}: {s.completed} done, {len(s.running)} running, {len(s.waiting)} waiting"
                + (f", {s.pool.hybrid.text()}" if s.pool is not None and s.pool.hybrid is not None else "")
                for s in self.latest.values())
                + (" · every request has been served; Start builds the server again" if done else ""))

    def _summary(self) -> None:
        """The numbers of each side so far, and A against B where both have some (each row says whether
        higher or lower is better, and the ratio is green where A is better)."""
        rows = ((None, "server time", "time", "{:.1f} s"), (1, "requests done", "completed", "{:.0f}"),
                (1, "tokens generated", "generated", "{:.0f}"), (1, "throughput", "throughput", "{:.2f} tok/s"),
                (-1, "mean TTFT", "ttft_mean", "{:.2f} s"), (-1, "mean ITL", "itl_mean", "{:.3f} s"),
                (-1, "peak KV pages", "peak_pages", "{:.0f}"), (-1, "peak reserved", "peak_reserved", "{:.0f}"),
                (-1, "preemptions", "preemptions", "{:.0f}"), (1, "prefix hit rate", "hit_rate", "{:.0f}%"),
                (-1, "rejected (too long)", "rejected", "{:.0f}"))
        numbers = {side: s.summary() for side, s in self.series.items()}
        if not any(numbers.values()):
            self.summary.setText(theme.muted("the numbers of each side appear with its first step"))
            return
        head = "".join(f"<th style='color:{SIDE_COLORS[side]}'>{side}</th>" for side in numbers)
        ratio = len(numbers) == 2 and all(numbers.values())
        body = ""
        for better, label, key, fmt in rows:
            if key == "rejected" and not any(n.get(key) for n in numbers.values()):
                continue
            cells = "".join(f"<td align=right>&nbsp;{fmt.format(n[key]) if n and n[key] == n[key] else '–'}</td>"
                            for n in numbers.values())
            if ratio:
                cells += ratio_cells(numbers["A"][key], numbers["B"][key], better, numbers)
            body += f"<tr><td>{label}</td>{cells}</tr>"
        head += "<th>&nbsp;A/B</th><th></th>" if ratio else ""
        early = len(numbers) == 2 and any(not n or n["completed"] < MIN_SERVED for n in numbers.values())
        note = theme.muted(f"A/B once both have served {MIN_SERVED} requests") if early else ""
        self.summary.setText(f"<table cellspacing=0><tr><th></th>{head}</tr>{body}</table>{note}")

    # --- closing -----------------------------------------------------------------------------------------
    def shutdown(self, timeout_ms: int = 30000) -> bool:
        """Stop the worker after its step and wait for it."""
        self.pause()
        return QThreadPool.globalInstance().waitForDone(timeout_ms)

    def showEvent(self, event) -> None:
        self.closed = False
        super().showEvent(event)

    def closeEvent(self, event) -> None:
        self.closed = True  # records the worker still delivers while it stops draw nothing
        self.redraw_timer.stop()
        self._jobs = []
        if self.worker is not None:
            self.shutdown()
            self.worker, self.control = None, None  # its queued `finished` may come after the window is gone
        self._close_sides()
        self.redraw_timer.stop()
        self._jobs, self._dirty = [], False  # a job queued after this would draw widgets Qt has deleted
        super().closeEvent(event)


MIN_SERVED = 8  # requests each side must have served before the summary compares them


def ratio_cells(a: float, b: float, better: int | None, numbers: dict) -> str:
    """The A/B cells of one summary row: A's value over B's, green where A is better and amber where it is
    worse, and which way is better. Blank until both sides have served MIN_SERVED requests (at 16 s one side's
    first answers made the throughput 15.96× against a steady ~2×: a number a presenter would quote) and both
    values are non-zero (a ratio of 0 or over 0 says nothing), and for rows that are not a result (the clock)."""
    both = all(n["completed"] >= MIN_SERVED for n in numbers.values())
    if better is None or not both or not (a == a and b == b) or a == 0 or b == 0:
        return "<td></td><td></td>"
    color = "#7ee787" if (a - b) * better > 0 else "#ffb020" if a != b else theme.TEXT
    way = "higher is better" if better > 0 else "lower is better"
    return f"<td align=right style='color:{color}'>&nbsp;{a / b:.2f}×</td><td>&nbsp;{theme.muted(way)}</td>"


def server_demo(app, spec, preset: ServerPreset | None, screenshot: str | None, steps: int, recording=None) -> int:
    """`pagevis --server-demo`: the window alone on the spec's model; with a screenshot, `steps` steps first;
    with a recording (pagevis.gui.video_frames.Request), `steps` steps, one frame each."""
    import sys

    from pagevis.gui import save_screenshot
    from pagevis.gui.widgets.export import default_size

    print(f"pagevis: loading {spec.label}…", file=sys.stderr)
    headless = bool(screenshot or recording)
    window = ServerWindow(spec.load(), preset or SERVER_PRESETS[0], model_label=spec.label,
                          realtime=not headless, autorun=not headless)
    if not headless:
        place_beside(window, None)  # alone: near the screen's top left, wholly on it
        window.show()
        return app.exec()
    real_display = app.platformName() not in ("offscreen", "minimal")
    if real_display:
        place_beside(window, None)  # as it opens for a user: a 1600 x 1000 window on a 1280 x 720 screen was cut
    else:
        window.resize(default_size())
    window.show()
    app.processEvents()
    if recording is not None:
        from pagevis.gui.video_frames import record_window

        return record_window(window, recording, steps)
    window.step_blocking(steps, every_step=False)
    app.processEvents()
    return save_screenshot(app, window, screenshot)

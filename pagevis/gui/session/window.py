"""The main window: controls, transport, dockable views, menus, status bar; wires the runner to the views.

Why one module of about 730 lines: one QMainWindow whose sections (layout, session, transport, rendering,
files, settings) act on the same docks, runner and transport; the views, controls, runner and exports it wires
live in their own modules. The next part to move out is the files section (the other windows, save and
export), into a module of its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer
from PySide6.QtGui import QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QToolBar,
    QLabel,
    QMainWindow,
    QMessageBox,
    QWidget,
)

from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError
from pagevis.kvcache.memory import hybrid_bytes
from pagevis.kvcache.spec import layer_specs
from pagevis.gui.widgets import theme
from pagevis.gui.session.controls import ControlsPanel
from pagevis.gui.session.files import FileActions
from pagevis.gui.session.presets import PresetPlayer, model_title
from pagevis.presets import PRESETS
from pagevis.gui.session.layout import FIRST_SCREEN_SHARE, NARRATION_STYLE, DockLayout, wants_presentation
from pagevis.gui.widgets.messages import MessagesPanel
from pagevis.viewmodel.narration import narrate
from pagevis.gui.session.runner import SessionRunner
from pagevis.viewmodel.timeline import Timeline
from pagevis.gui.widgets.transport import TimelineCursor, TransportBar
from pagevis.gui.widgets.windows import place_beside
from pagevis.viewmodel.view_state import ViewState
from pagevis.gui.widgets.attention import AttentionView
from pagevis.gui.widgets.events import EventsView
from pagevis.gui.widgets.heads import HeadsView
from pagevis.gui.widgets.histogram import HistogramView
from pagevis.gui.widgets.metrics import MetricsView
from pagevis.gui.widgets.page_grid import PageGridView
from pagevis.gui.widgets.text import TextView

FRAME_INTERVAL = 1 / 30  # redraw at most this often, however fast records arrive
MAX_FRAME_INTERVAL = 1 / 5  # ... and at least this often while records arrive
UI_SHARE = 0.12  # while decoding, the UI thread (redraws, painting, everything) may use this share of a core. Its
# Python holds the GIL the decoding worker needs: at one frame per SmolLM2 token (19 tok/s here) the UI took 20 %
# and the worker ran at 0.89x its headless speed; at 0.12 it draws ~12 frames a second and the worker runs at
# 0.94x (python -m pagevis.bench.gui.app; docs/gui.md). Only at max speed: see request_render.
STATUS_INTERVAL = 0.25  # while decoding, the status bar's step and speed change at most this often
SETTINGS_VERSION = 1


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def memory_text(cache_bytes: int, n_kv_heads: int, dtype: str = "", per_token: float = 0.0, notice: str = "") -> str:
    """The cache's K/V storage, and each KV head's share (every KV head has its own K and V pages); with
    the storage dtype and its bytes per token (all layers), the bits per token; with a storage notice, the
    headline of each of its clauses (the tooltip has them whole)."""
    if not cache_bytes:
        return "K/V —"
    text = f"K/V {_mib(cache_bytes)}"
    if n_kv_heads > 0:
        text += f" = {n_kv_heads} KV heads × {_mib(cache_bytes // n_kv_heads)}"
    if dtype and per_token:
        text += f" · {dtype}, {8 * per_token / 1000:,.1f} kbit per token"
    for clause in filter(None, notice.split("; ")):
        text += f" · {clause.split(': ')[0]}"
    return text


def hybrid_memory_text(info, record) -> str:
    """A hybrid cache's K/V at the step shown, by layer type, against every layer global at that length."""
    held = hybrid_bytes(layer_specs(info.sliding_windows, info.n_layers), [len(t) for t in record.block_tables],
                        info.page_bytes, max(record.positions, default=-1) + 1, info.config.page_size)
    return held.text()


class MainWindow(FileActions, TimelineCursor, QMainWindow):
    def __init__(self, settings: QSettings | None = None, restore: bool = True, persist: bool = True):
        """`restore`: start from the saved layout and configuration; `persist`: save them on close."""
        super().__init__()
        self.persist = persist
        self.setWindowTitle("pagevis — paged KV cache, live")
        self.setWindowIcon(theme.icon("pagevis"))
        self.settings = settings if settings is not None else QSettings()
        self.runner = SessionRunner(self)
        self.timeline: Timeline | None = None
        self.index = -1  # the record the views show
        self.follow = True  # keep showing the newest record as records arrive
        self.frames = 0  # redraws so far (the benchmark reads it)
        self.ab_window = None  # the A/B window, once opened
        self.tour = None  # Help ▸ Tour, once started
        self._savers: list = []  # workers writing traces
        self._last_frame = 0.0
        self._restart_reason = ""
        self._replay_timer = QTimer(self, interval=100)
        self._replay_timer.timeout.connect(self._replay_tick)
        self._shown_at: dict[str, float] = {}  # when each view last rendered
        self._status_at = 0.0  # when the status bar's step and speed were last set
        self._interval = FRAME_INTERVAL  # the current pace of redraws while decoding (see _pace)
        self._cpu_mark = (time.perf_counter(), time.thread_time())
        self._frame_timer = QTimer(self, singleShot=True)
        self._frame_timer.timeout.connect(self.redraw)
        self._slow_timer = QTimer(self, singleShot=True, interval=5)  # the next slow view, a turn later
        self._slow_timer.timeout.connect(self._show_slow_views)
        self._catch_up = QTimer(self, singleShot=True)  # shows the slow views' turn when it comes
        self._catch_up.timeout.connect(self._show_slow_views)

        self.transport = TransportBar(self)
        self.addToolBar(Qt.TopToolBarArea, self.transport)
        self.addToolBarBreak(Qt.TopToolBarArea)
        self.narration = QLabel("")  # one line: what the cache did at the shown step (selected layer)
        self.narration.setObjectName("narration")
        self.narration.setTextFormat(Qt.PlainText)  # token texts like '<0xA5>' are not markup
        self.narration.setStyleSheet(NARRATION_STYLE)
        self.narration.setTextInteractionFlags(Qt.TextSelectableByMouse)
        narration_bar = QToolBar("Narration", self)
        narration_bar.setObjectName("narration_bar")
        narration_bar.setMovable(False)
        narration_bar.addWidget(self.narration)
        self.addToolBar(Qt.TopToolBarArea, narration_bar)
        self.presets = PresetPlayer(self)  # the chosen preset's point: a line under the narration
        self.addToolBarBreak(Qt.TopToolBarArea)
        self.addToolBar(Qt.TopToolBarArea, self.presets.banner)
        self.controls = ControlsPanel()
        self.page_grid = PageGridView()
        self.attention = AttentionView()
        self.text = TextView()
        self.events = EventsView()
        self.metrics = MetricsView()
        self.heads = HeadsView()
        self.histogram = HistogramView()
        self.views = [self.page_grid, self.attention, self.text, self.events, self.metrics, self.heads,
                      self.histogram]
        self.messages = MessagesPanel()
        self.docks: dict[str, QDockWidget] = {}
        self.layout_ = DockLayout(self)
        self.setDockNestingEnabled(True)
        self.setCorner(Qt.BottomLeftCorner, Qt.LeftDockWidgetArea)
        for widget, title in ((self.controls, "Controls"), *((v, v.title) for v in self.views),
                              (self.messages, "Messages")):
            self._add_dock(widget, title)
        self._default_layout()
        self._build_status_bar()
        self._build_menus()
        self._connect()
        self._default_state = self.saveState(SETTINGS_VERSION)
        self._size_docks_on_show = not (restore and self._restore_settings())
        if self._size_docks_on_show:
            if wants_presentation(QGuiApplication.instance(), self.screen()):
                self.set_presentation(True)
            self.fit_to_screen()
        self.redraw()  # the views' empty state from the start, not pyqtgraph's default axes

    # --- layout ----------------------------------------------------------------------------------
    def _add_dock(self, widget: QWidget, title: str) -> None:
        dock = QDockWidget(title, self)
        dock.setObjectName(title.lower().replace(" ", "_"))
        dock.setWidget(widget)
        dock.visibilityChanged.connect(lambda visible: visible and self.request_render())  # a raised tab
        self.docks[title] = dock

    def _default_layout(self) -> None:
        self.layout_.default()

    def size_docks(self) -> None:
        """The docks in their proportions at the window's size (pagevis.gui.session.layout)."""
        self.layout_.size_docks()

    def fit_to_screen(self, share: float = FIRST_SCREEN_SHARE) -> None:
        self.layout_.fit_to_screen(share)

    def set_presentation(self, on: bool) -> None:
        """The presentation layout (View ▸ Presentation, F11): the page grid fills most of the window."""
        self.layout_.set_presentation(on)

    @property
    def presentation(self) -> bool:
        return self.layout_.presentation

    def showEvent(self, event) -> None:
        """The first time, without a saved layout: the default proportions at the size the window opens at."""
        super().showEvent(event)
        if self._size_docks_on_show:
            self._size_docks_on_show = False
            self.size_docks()

    def reset_layout(self) -> None:
        if self.presentation:
            self.layout_.set_presentation(False, arrange=False)
        self.restoreState(self._default_state, SETTINGS_VERSION)
        self._default_layout()
        self.statusBar().showMessage("Layout reset", 3000)

    def _build_status_bar(self) -> None:
        bar = self.statusBar()
        self.status_model = QLabel("no model")
        self.status_step = QLabel("step —")
        self.status_speed = QLabel("— tok/s")
        self.status_memory = QLabel("K/V —")
        self.status_state = QLabel("idle")
        for label in (self.status_state, self.status_model, self.status_step, self.status_speed,
                      self.status_memory):
            label.setStyleSheet(f"color: {theme.MUTED}; padding: 0 8px;")
            bar.addPermanentWidget(label)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction("Open &GGUF model…", self.open_gguf, QKeySequence("Ctrl+O"))
        file_menu.addAction("Open &trace…", self.choose_trace, QKeySequence("Ctrl+Shift+O"))
        file_menu.addAction("&Save trace…", self.save_trace, QKeySequence.Save)
        file_menu.addSeparator()
        export_menu = file_menu.addMenu("&Export view")
        for view in self.views:
            export_menu.addAction(f"{view.title}…", lambda v=view: self.export_view(v))
        export_menu.addAction("Whole window…", lambda: self.export_view(None))
        file_menu.addAction("Export &events (CSV)…", self.export_events)
        file_menu.addAction("Export &metrics (CSV)…", self.export_metrics)
        file_menu.addAction("Export &recording (MP4, WebM, GIF)…", self.export_recording)
        file_menu.addAction("Export &HTML page…", self.export_html)
        file_menu.addSeparator()
        file_menu.addAction("&Quit", self.close, QKeySequence.Quit)
        play_menu = self.menuBar().addMenu("&Decode")
        t = self.transport
        for action in (t.play_action, t.step_action, t.reset_action, t.previous_action, None, t.back_action,
                       t.forward_action, t.first_action, t.last_action):
            if action is None:
                play_menu.addSeparator()
            else:
                play_menu.addAction(action)
                self.addAction(action)  # shortcuts work whichever dock has focus
        play_menu.addSeparator()
        play_menu.addAction("&A/B compare…", self.open_ab, QKeySequence("Ctrl+B"))
        demo_menu = self.menuBar().addMenu("De&mo")  # the presets, also where the controls are a tab away
        for preset in PRESETS:
            action = demo_menu.addAction(preset.name + (" (A/B)" if preset.b is not None else ""),
                                         lambda p=preset: self.apply_preset(p))
            action.setToolTip(preset.description)
        demo_menu.addSeparator()
        demo_menu.addAction("&Tour", self.start_tour)
        view_menu = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view_menu.addAction(dock.toggleViewAction())
        view_menu.addSeparator()
        self.presentation_action = view_menu.addAction("&Presentation")
        self.presentation_action.setShortcut(QKeySequence("F11"))
        self.presentation_action.setCheckable(True)
        self.presentation_action.triggered.connect(self.set_presentation)  # (checked)
        self.presentation_action.setToolTip("the page grid fills the window, the other views one tab away")
        self.addAction(self.presentation_action)
        for text, keys, change in (("Ne&xt layer", "Ctrl+Up", 1), ("Pre&vious layer", "Ctrl+Down", -1)):
            action = view_menu.addAction(text, lambda c=change: self.controls.layer.stepBy(c), QKeySequence(keys))
            self.addAction(action)
        view_menu.addSeparator()
        view_menu.addAction("&Sequences sharing one pool…", self.open_sequences)
        view_menu.addAction("Se&rver: requests arriving…", self.open_server)
        attach_menu = view_menu.addMenu("&Attach: another engine's KV cache")
        attach_menu.addAction("&Endpoints (vLLM, SGLang, pagevis serve)…", self.open_attach)
        attach_menu.addAction("&Play a KV-event recording…", self.open_attach_recording)
        view_menu.addAction("&Reset layout", self.reset_layout)
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction("&Tour", self.start_tour)
        help_menu.addAction("&Keyboard shortcuts", self._show_shortcuts)

    def _connect(self) -> None:
        t, r = self.transport, self.runner
        t.play_action.triggered.connect(self.toggle_play)
        t.step_action.triggered.connect(self.step)
        t.reset_action.triggered.connect(lambda: self.restart("reset"))
        t.previous_action.triggered.connect(self.back_to_previous)
        t.back_action.triggered.connect(lambda: self.scrub(self.index - 1))
        t.forward_action.triggered.connect(lambda: self.scrub(self.index + 1))
        t.first_action.triggered.connect(lambda: self.scrub(0))
        t.last_action.triggered.connect(lambda: self.scrub(len(self.timeline) - 1 if self.timeline else -1))
        t.scrubbed.connect(self.scrub)
        t.speed_changed.connect(self._speed_changed)
        r.started.connect(self._session_started)
        r.records.connect(self._records_arrived)
        r.failed.connect(self._failed)
        r.state_changed.connect(self._state_changed)
        r.message.connect(lambda text: self.statusBar().showMessage(text, 5000))
        self.controls.session_changed.connect(lambda *_: self.presets.settings_changed())
        self.controls.session_changed.connect(self.restart)
        self.controls.preset_chosen.connect(self.apply_preset)
        self.controls.view_changed.connect(self.request_render)

    # --- session ---------------------------------------------------------------------------------
    def start(self, blocking: bool = False) -> None:
        """Start a session with the configuration the controls show."""
        self.restart("", blocking=blocking)

    def restart(self, reason: str = "reset", blocking: bool = False) -> None:
        try:
            config = self.controls.session_config()
        except (ConfigError, ValueError) as error:
            self.statusBar().showMessage(f"Not restarted: {error}", 8000)
            return
        if self.runner.state == "replay" and not self.leave_replay(reason):
            return
        self._replay_timer.stop()
        self._restart_reason = reason
        self._clear_messages()
        self.runner.configure(self.controls.model_spec(), self.controls.prompt(), config, blocking=blocking)

    def apply_preset(self, preset) -> None:
        """The preset's settings, its point in the banner, playing (pagevis.gui.session.presets)."""
        self.presets.apply(preset)

    def open_ab(self, config_a=None, config_b=None, prompt: str | None = None, title: str = "",
                blocking: bool = False, play: bool = False, text: str | None = None):
        """Open the A/B window: by default A is the controls' configuration and B the same cache with the
        other of sinks / oldest (the StreamingLLM comparison). With `play` (a preset), both sides decode
        once the model is ready."""
        from pagevis.gui.ab.window import ABWindow

        try:
            config_a = config_a or self.controls.session_config()
        except (ConfigError, ValueError) as error:
            self.statusBar().showMessage(f"No A/B: {error}", 8000)
            return None
        if config_b is None:
            config_b = replace(config_a, policy="oldest" if config_a.policy != "oldest" else "sinks", policy_params={})
        if self.ab_window is not None:
            self.ab_window.close()
        self.ab_window = ABWindow(self.controls.model_spec(), prompt or self.controls.prompt(), config_a, config_b,
                                  title=title, text=text)
        place_beside(self.ab_window, self)
        self.ab_window.show()
        self.ab_window.start(blocking=blocking, play=play)
        return self.ab_window

    def leave_replay(self, reason: str) -> bool:
        """Ask before a change ends the replay; on no, the controls show the replay's settings again."""
        name = self.timeline.info.model_label if self.timeline is not None else "the trace"
        if self.confirm("Leave the replay?", f"{reason[:1].upper()}{reason[1:]}: start a live session and leave the "
                        f"replay of {name}? (Decode ▸ Back to previous run returns to it.)"):
            return True
        info = self.timeline.info
        self.controls.set_configuration(prompt=info.prompt, config=info.config)
        self.statusBar().showMessage("Still replaying: nothing changed", 5000)
        return False

    def confirm(self, title: str, question: str) -> bool:
        answer = QMessageBox.question(self, title, question, QMessageBox.Yes | QMessageBox.No, QMessageBox.Yes)
        return answer == QMessageBox.Yes

    def back_to_previous(self) -> None:
        """Swap the current session with the previous one (kept on every restart), both still resumable."""
        if self.runner.busy:
            self.runner.stop()
            self.statusBar().showMessage("Paused: press Ctrl+Z again to return to the previous run", 5000)
            return
        if not self.runner.swap_previous():
            self.statusBar().showMessage("No previous run to return to", 4000)
            return
        runner = self.runner
        self.controls.set_configuration(runner.spec, runner.prompt, runner.config)
        self.statusBar().showMessage(f"Back to the previous run ({len(runner.timeline)} steps); "
                                     "Ctrl+Z swaps again", 6000)

    def _clear_messages(self) -> None:
        """Messages belong to the session that produced them: a new one starts with none."""
        self.messages.clear()
        self.docks["Messages"].hide()

    def _session_started(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.index, self.follow = -1, True
        self._status_at = 0.0  # the new session's first record sets the status bar at once
        info = timeline.info
        self.controls.set_model_shape(info.n_layers, info.n_heads, info.n_kv_heads,
                                      [spec.label for spec in layer_specs(info.sliding_windows, info.n_layers)]
                                      if info.sliding_windows is not None else None)
        saved_layer = getattr(self.controls, "_saved_layer", None)
        if saved_layer is not None:
            self.controls._saved_layer = None
            self.controls.layer.setValue(min(saved_layer, info.n_layers - 1))
        if len(timeline):
            self.index = len(timeline) - 1
        self.statusBar().clearMessage()
        title = model_title(info.model_label, self.presets.titles)
        self.setWindowTitle(f"pagevis — {title}, replay" if self.runner.state == "replay"
                            else f"pagevis — {title}, paged KV cache, live")
        self.status_model.setText(title)
        self.status_model.setToolTip(info.model_label)
        self.status_memory.setText(memory_text(info.cache_bytes, info.n_kv_heads, info.config.dtype,
                                               info.kv_bytes_per_token, info.storage_notice))
        self.status_memory.setToolTip(f"K/V storage, all layers, one sequence at capacity: {info.storage}"
                                      if info.storage else "")
        previous = self.runner.previous
        if self._restart_reason:
            # short enough for the status bar of a 1280-px window beside its permanent fields
            kept = f" · Ctrl+Z: the previous run ({len(previous.timeline)} steps)" if previous is not None else ""
            self.statusBar().showMessage(f"{self._restart_reason[0].upper()}{self._restart_reason[1:]}: "
                                         f"restarted{kept}", 8000)
        self.transport.previous_action.setEnabled(previous is not None)
        self._restart_reason = ""
        self.request_render()
        self.presets.session_started()

    def open_trace(self, path: str) -> bool:
        try:
            from pagevis.trace import TraceError, read_trace
        except ImportError:
            self._report("Traces cannot be opened yet: pagevis.trace is not available in this installation.")
            return False
        try:
            trace = read_trace(path)
        except (TraceError, OSError, ValueError, MemoryError) as error:
            self._report(f"Could not open trace {path}: {error}")
            return False
        self.runner.replay(trace)
        self.setWindowTitle(f"pagevis — replay of {Path(path).name} ({model_title(trace.model_label)})")
        self.controls.set_configuration(prompt=trace.prompt, config=trace.config)
        self.scrub(0)
        self.statusBar().showMessage(f"Replaying {Path(path).name}: {len(trace.records)} steps "
                                     f"(play animates them; Reset returns to live decoding)", 8000)
        return True

    # --- transport -------------------------------------------------------------------------------
    def toggle_play(self) -> None:
        if self.runner.state == "replay":
            if self._replay_timer.isActive():
                self._replay_timer.stop()
            else:
                if self.index >= len(self.timeline) - 1:
                    self.scrub(0)
                self._replay_timer.start()
            self.transport.set_playing(self._replay_timer.isActive())
            return
        if self.runner.running:
            self.runner.stop()
        else:
            self.follow = True
            self.runner.play()

    def _replay_tick(self) -> None:
        if self.timeline is None or self.index >= len(self.timeline) - 1:
            self._replay_timer.stop()
            self.transport.set_playing(False)
            return
        self.scrub(self.index + 1)

    def _speed_changed(self, seconds: float) -> None:
        self.runner.set_interval(seconds)
        self._replay_timer.setInterval(int(max(seconds, 1 / 30) * 1000))

    def _records_arrived(self, records: list) -> None:
        if self.follow and self.timeline is not None:
            self.index = len(self.timeline) - 1
        self.request_render()

    def _state_changed(self, state: str) -> None:
        self.transport.set_playing(state == "running" and self.runner.running)
        if state != "running":
            self.request_render()  # views that refresh slowly while decoding catch up
        self.status_state.setText(state)
        self.transport.step_action.setEnabled(state not in ("loading", "idle"))
        self.transport.play_action.setEnabled(state not in ("loading", "idle"))
        if state == "done" and self.runner.session is not None:
            self.statusBar().showMessage(f"Finished: {self.runner.session.stop_reason}", 5000)

    def _failed(self, message: str, trace: str) -> None:
        self._report(message, trace)

    def _report(self, message: str, detail: str = "") -> None:
        """Show a problem without blocking: one line in the status bar and the Messages panel (raised), the
        traceback (if any) behind the panel's Details toggle."""
        self.statusBar().showMessage(message.strip().partition("\n")[0], 15000)
        self.messages.report(message, detail)
        dock = self.docks["Messages"]
        dock.show()
        dock.raise_()

    # --- rendering -------------------------------------------------------------------------------
    def view_state(self) -> ViewState:
        options = self.controls.view_options()
        if self.timeline is not None:
            options["layer"] = min(options["layer"], self.timeline.info.n_layers - 1)
            if options["head"] is not None and options["head"] >= self.timeline.info.n_heads:
                options["head"] = None
        loading = None
        if self.timeline is None and self.runner.state == "loading":
            try:  # the pool the loading session will have, shown while the model loads
                loading = self.controls.session_config()
            except (ConfigError, ValueError):
                pass
        return ViewState(self.timeline, self.index, loading=loading, **options)

    def request_render(self) -> None:
        """Redraw soon: at once if the last frame is older than FRAME_INTERVAL, else when it is."""
        if self._frame_timer.isActive():
            return
        # at max speed the pace keeps the UI's share of the GIL down; at a chosen playback speed the decoder
        # waits between steps anyway, and every step gets its frame
        interval = self._pace() if self.runner.running and not self.runner.interval else FRAME_INTERVAL
        wait = self._last_frame + interval - time.perf_counter()
        self._frame_timer.start(max(0, int(wait * 1000)))

    def redraw(self) -> None:
        """Show the selected record in every visible view. While decoding runs, the views that are watched
        (page grid, attention) draw now and the others follow in later event-loop turns, each at most
        as often as its `live_interval`: no single turn paints the whole window, so input never waits
        for a full repaint. Once decoding stops, every view shows the selected record."""
        self._frame_timer.stop()
        self._last_frame = time.perf_counter()
        self.frames += 1
        state = self.view_state()
        now = time.perf_counter()
        if not self.runner.running:
            self._show(self.views, state, now)
        else:
            self._show([v for v in self.views if not getattr(v, "live_interval", 0.0)], state, now)
            self._slow_timer.start()
        self._update_transport(state)

    def _shown(self, view) -> bool:
        """Should the view be drawn? Not when its dock is closed; a costly view (`only_when_visible`) not
        either while it is behind another dock's tab (Qt keeps such a dock 'visible' but off the window):
        it is drawn when its tab is raised."""
        dock = self.docks[view.title]
        if dock.isHidden():
            return False
        return not (getattr(view, "only_when_visible", False) and self.isVisible() and dock.visibleRegion().isEmpty())

    def _show(self, views, state: ViewState, now: float) -> None:
        for view in views:
            if self._shown(view):
                self._shown_at[view.title] = now
                view.show_state(state)

    def _pace(self) -> float:
        """Seconds between redraws while decoding: adjusted so that the UI thread's CPU time (redraws,
        painting, everything) stays near UI_SHARE of the wall clock, between 30 and 5 frames a second.
        On a small or busy machine the decoder keeps its speed and the screen gets fewer frames."""
        wall, cpu = time.perf_counter(), time.thread_time()
        elapsed = wall - self._cpu_mark[0]
        if elapsed >= 0.25:
            share = (cpu - self._cpu_mark[1]) / elapsed
            self._cpu_mark = (wall, cpu)
            factor = min(max(share / UI_SHARE, 0.5), 2.0)
            self._interval = min(max(self._interval * factor ** 0.5, FRAME_INTERVAL), MAX_FRAME_INTERVAL)
        return self._interval

    def _show_slow_views(self) -> None:
        """While decoding: the slow view waiting longest, if its turn came, and the next one a turn later;
        when none is due, come back when the first is. Once decoding stopped: all of them, and no more turns."""
        state = self.view_state()
        now = time.perf_counter()
        slow = [v for v in self.views if getattr(v, "live_interval", 0.0) and self._shown(v)]
        if not self.runner.running:
            self._show(slow, state, now)
            return
        slow.sort(key=lambda v: self._shown_at.get(v.title, 0.0))
        for view in slow:
            if now - self._shown_at.get(view.title, 0.0) >= view.live_interval:
                self._show([view], state, now)
                self._slow_timer.start()
                return
        if slow and not self._catch_up.isActive():
            wait = min(v.live_interval - (now - self._shown_at.get(v.title, 0.0)) for v in slow)
            self._catch_up.start(max(1, int(wait * 1000)))

    def _update_transport(self, state: ViewState) -> None:
        timeline, record = state.timeline, state.record
        count = len(timeline) if timeline is not None else 0
        if record is None:
            self.transport.set_range(0, 0, "no steps yet" if timeline is not None else "no session")
            self.transport.slider.set_marks(np.zeros(0))
            self.narration.setText("Press Space to play, → to decode one token" if timeline is not None else "")
            self.status_step.setText("step —")
            self.status_speed.setText("— tok/s")  # not the previous run's speed
            return
        label = f"step {state.index} / {count - 1} · {record.kind}"
        self.transport.set_range(count, state.index, label)
        self.transport.slider.set_marks(timeline.eviction_steps())
        self.narration.setText(narrate(record, state.layer, timeline.position_text, timeline.info.config.policy))
        now = time.perf_counter()
        if self.runner.running and now - self._status_at < STATUS_INTERVAL:
            return  # the status bar repeats the transport's step and is read, not watched: 4× a second
        self._status_at = now
        self.status_step.setText(f"step {state.index}: {record.kind} of {len(record.token_ids)} token"
                                 f"{'s' if len(record.token_ids) != 1 else ''}")
        speed = timeline.tokens_per_second(state.index)
        self.status_speed.setText(f"{speed:.1f} tok/s" if speed == speed else "— tok/s")
        info = timeline.info
        if info.sliding_windows is not None and info.page_bytes:
            self.status_memory.setText(hybrid_memory_text(info, record))

    # --- settings and closing ----------------------------------------------------------------------
    def _restore_settings(self) -> bool:
        """Restore the saved layout and configuration; True if there was a saved geometry."""
        s = self.settings
        geometry = s.value("window/geometry")
        restored = isinstance(geometry, QByteArray) and not geometry.isEmpty() and self.restoreGeometry(geometry)
        state = s.value("window/state")
        if isinstance(state, QByteArray) and not state.isEmpty():
            self.restoreState(state, SETTINGS_VERSION)
            if s.value("window/presentation") in (True, "true"):  # the docks are already where it puts them
                self.layout_.set_presentation(True, arrange=False)
        raw = s.value("session/config")
        if isinstance(raw, str) and raw:
            try:
                self.controls.from_dict(json.loads(raw))
            except (ValueError, TypeError):
                pass
        return bool(restored)

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState(SETTINGS_VERSION))
        s.setValue("window/presentation", self.presentation)
        try:
            s.setValue("session/config", json.dumps(self.controls.to_dict()))
        except (ConfigError, ValueError):
            pass
        s.sync()

    def apply_arguments(self, spec: ModelSpec | None, prompt: str | None, config: SessionConfig | None) -> None:
        self.controls.set_configuration(spec, prompt, config)

    def closeEvent(self, event) -> None:
        self._frame_timer.stop()
        self._catch_up.stop()
        self._slow_timer.stop()
        self._replay_timer.stop()
        if self.persist:
            self.save_settings()
        try:
            self.runner.records.disconnect(self._records_arrived)
        except (RuntimeError, TypeError):
            pass
        if self.ab_window is not None:
            self.ab_window.close()
        if not self.runner.shutdown():
            self.messages.appendPlainText("the decoder did not stop within 15 s")
        super().closeEvent(event)

"""The main window: controls, transport, dockable views, menus, status bar; wires the runner to the views.

MainWindow holds its parts, each an object in its own module that gets the window: sessions (lifecycle.py,
`lifecycle`), drawing (rendering.py, `renderer`), files and other windows (files.py, `files`), the step shown
(widgets/transport.py, `cursor`), the dock layouts (layout.py, `layout_`) and presets (presets.py, `presets`). The
window keeps the state they share (`timeline`, `index`, `follow`, `ab_window`), builds itself, its menus and signals,
reports problems, saves and restores its settings, and passes on the few verbs other modules call on it (start,
restart, open_trace, open_ab, apply_preset, toggle_play, step, scrub, redraw, open_sequences, open_server,
start_tour).
"""

from __future__ import annotations

import json

from PySide6.QtCore import QByteArray, QSettings, Qt
from PySide6.QtGui import QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QToolBar,
    QLabel,
    QMainWindow,
    QWidget,
)

from pagevis.engine import ModelSpec, SessionConfig
from pagevis.kvcache import ConfigError
from pagevis.gui.widgets import theme
from pagevis.gui.session.controls import ControlsPanel
from pagevis.gui.session.files import FileActions
from pagevis.gui.session.lifecycle import SessionLifecycle
from pagevis.gui.session.rendering import Renderer
from pagevis.gui.session.presets import PresetPlayer
from pagevis.presets import PRESETS
from pagevis.gui.session.layout import FIRST_SCREEN_SHARE, NARRATION_STYLE, SMALL_HEIGHT, DockLayout, wants_presentation
from pagevis.gui.widgets.messages import MessagesPanel
from pagevis.gui.widgets.steady_label import SteadyLabel
from pagevis.gui.session.runner import SessionRunner
from pagevis.viewmodel.timeline import Timeline
from pagevis.gui.widgets.transport import TimelineCursor, TransportBar
from pagevis.gui.widgets.attention_heatmap import AttentionView
from pagevis.gui.widgets.events import EventsView
from pagevis.gui.widgets.heads import HeadsView
from pagevis.gui.widgets.histogram import HistogramView
from pagevis.gui.widgets.metrics import MetricsView
from pagevis.gui.widgets.page_grid import PageGridView
from pagevis.gui.widgets.text import TextView

SETTINGS_VERSION = 1


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings | None = None, restore: bool = True, persist: bool = True):
        """`restore`: start from the saved layout and configuration; `persist`: save them on close."""
        super().__init__()
        self.persist = persist
        # whose configuration the controls show (save_settings), whether it was restored, what the first session says
        self.session_source, self.restored_config, self.start_note = "own", False, ""
        self.setWindowTitle("pagevis — paged KV cache, live")
        self.setWindowIcon(theme.icon("pagevis"))
        self.settings = settings if settings is not None else QSettings()
        self.runner = SessionRunner(self)
        self.files = FileActions(self)  # the File menu and the windows opened beside this one
        self.renderer = Renderer(self)  # draws the record at `index` in the views, frames paced
        self.lifecycle = SessionLifecycle(self)  # starts, restarts, replays and presets sessions
        self.cursor = TimelineCursor(self)  # step / scrub: which recorded step the views show
        self.timeline: Timeline | None = None
        self.index = -1  # the record the views show
        self.follow = True  # keep showing the newest record as records arrive
        self.ab_window = None  # the A/B window, once opened (lifecycle.open_ab)

        self.transport = TransportBar(self)
        self.addToolBar(Qt.TopToolBarArea, self.transport)
        self.addToolBarBreak(Qt.TopToolBarArea)
        self.narration = SteadyLabel(expanding=True)  # one line: what the cache did at the shown step (selected layer)
        self.narration.setObjectName("narration")
        self.narration.setTextFormat(Qt.PlainText)  # token texts like '<0xA5>' are not markup
        self.narration.setStyleSheet(NARRATION_STYLE)
        self.narration.setTextInteractionFlags(Qt.TextSelectableByMouse)
        narration_bar = QToolBar("Narration", self)
        narration_bar.setObjectName("narration_bar")
        narration_bar.setMovable(False)
        narration_bar.addWidget(self.narration.holder)
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
        dock.visibilityChanged.connect(lambda visible: visible and self.renderer.request_render())  # a raised tab
        self.docks[title] = dock

    def _default_layout(self) -> None:
        self.layout_.default()

    def size_docks(self) -> None:
        """The docks in their proportions at the window's size (pagevis.gui.session.layout)."""
        self.layout_.size_docks()

    def fit_to_screen(self, share: float = FIRST_SCREEN_SHARE) -> None:
        self.layout_.fit_to_screen(share)

    def set_presentation(self, on: bool) -> None:
        """The presentation layout (View ▸ Presentation, F5): the page grid fills most of the window."""
        self.layout_.set_presentation(on)

    @property
    def presentation(self) -> bool:
        return self.layout_.presentation

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.lifecycle.fit_model_status()

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
        # set with every frame while decoding: SteadyLabels, so that a new text does not lay the window out again
        self.status_step = SteadyLabel("step —")
        self.status_speed = SteadyLabel("— tok/s")
        self.status_memory = QLabel("K/V —")
        self.status_state = QLabel("idle")
        for label in (self.status_state, self.status_model, self.status_step, self.status_speed,
                      self.status_memory):
            label.setStyleSheet(f"color: {theme.MUTED}; padding: 0 8px;")
            bar.addPermanentWidget(getattr(label, "holder", label))
        bar.messageChanged.connect(self._message_shown)

    def _message_shown(self, text: str) -> None:
        """A message wider than the status bar's room beside its fields goes whole to View ▸ Messages too (the
        bar clips it; the line there keeps every word)."""
        bar = self.statusBar()
        fields = (self.status_state, self.status_model, self.status_step.holder, self.status_speed.holder,
                  self.status_memory)
        room = min((f.x() for f in fields if f.isVisible()), default=bar.width()) - 16  # the message's area
        said = self.messages.toPlainText().rstrip().rpartition("\n")[2]  # report() has put it there already
        if text and bar.fontMetrics().horizontalAdvance(text) > room and not said.endswith(text):
            self.messages.report(text)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction("Open &GGUF model…", self.files.open_gguf, QKeySequence("Ctrl+O"))
        file_menu.addAction("Open &trace…", self.files.choose_trace, QKeySequence("Ctrl+Shift+O"))
        file_menu.addAction("&Save trace…", self.files.save_trace, QKeySequence.Save)
        file_menu.addSeparator()
        export_menu = file_menu.addMenu("&Export view")
        for view in self.views:
            export_menu.addAction(f"{view.title}…", lambda v=view: self.files.export_view(v))
        export_menu.addAction("Whole window…", lambda: self.files.export_view(None))
        file_menu.addAction("Export &events (CSV)…", self.files.export_events)
        file_menu.addAction("Export &metrics (CSV)…", self.files.export_metrics)
        file_menu.addAction("Export &recording (MP4, WebM, GIF)…", self.files.export_recording)
        file_menu.addAction("Export &HTML page…", self.files.export_html)
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
        play_menu.addAction("&A/B compare…", self.lifecycle.open_ab, QKeySequence("Ctrl+B"))
        demo_menu = self.menuBar().addMenu("De&mo")  # the presets, also where the controls are a tab away
        for preset in PRESETS:
            action = demo_menu.addAction(preset.title, lambda p=preset: self.lifecycle.apply_preset(p))
            action.setToolTip(preset.description)
        demo_menu.addSeparator()
        demo_menu.addAction("&Tour", self.files.start_tour)
        view_menu = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view_menu.addAction(dock.toggleViewAction())
        view_menu.addSeparator()
        self.presentation_action = view_menu.addAction("&Presentation")
        self.presentation_action.setShortcut(QKeySequence("F5"))  # a slide show's key; F11 is full screen
        self.presentation_action.setCheckable(True)
        self.presentation_action.triggered.connect(self.set_presentation)  # (checked)
        self.presentation_action.setToolTip("the page grid fills the window, the other views one tab away")
        self.addAction(self.presentation_action)
        full_screen = view_menu.addAction("&Full screen", lambda: self.showNormal() if self.isFullScreen()
                                          else self.showFullScreen(), QKeySequence("F11"))
        self.addAction(full_screen)
        for text, keys, change in (("Ne&xt layer", "Ctrl+Up", 1), ("Pre&vious layer", "Ctrl+Down", -1)):
            action = view_menu.addAction(text, lambda c=change: self.controls.layer.stepBy(c), QKeySequence(keys))
            self.addAction(action)
        view_menu.addSeparator()
        view_menu.addAction("&Sequences sharing one pool…", self.files.open_sequences)
        view_menu.addAction("Se&rver: requests arriving…", self.files.open_server)
        attach_menu = view_menu.addMenu("&Attach: another engine's KV cache")
        attach_menu.addAction("&Endpoints (vLLM, SGLang, pagevis serve)…", self.files.open_attach)
        attach_menu.addAction("&Play a KV-event recording…", self.files.open_attach_recording)
        view_menu.addAction("&Reset layout", self.reset_layout)
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction("&Tour", self.files.start_tour)
        help_menu.addAction("&Keyboard shortcuts", self.files.show_shortcuts)

    def _connect(self) -> None:
        t, r = self.transport, self.runner
        t.play_action.triggered.connect(self.lifecycle.toggle_play)
        t.step_action.triggered.connect(self.step)
        t.reset_action.triggered.connect(lambda: self.lifecycle.restart("reset"))
        t.previous_action.triggered.connect(self.lifecycle.back_to_previous)
        t.back_action.triggered.connect(lambda: self.scrub(self.index - 1))
        t.forward_action.triggered.connect(lambda: self.scrub(self.index + 1))
        t.first_action.triggered.connect(lambda: self.scrub(0))
        t.last_action.triggered.connect(lambda: self.scrub(len(self.timeline) - 1 if self.timeline else -1))
        t.scrubbed.connect(self.scrub)
        t.speed_changed.connect(self.lifecycle.speed_changed)
        r.started.connect(self.lifecycle.session_started)
        r.records.connect(self._records_arrived)
        r.failed.connect(self._failed)
        r.state_changed.connect(self._state_changed)
        r.message.connect(lambda text: self.statusBar().showMessage(text, 5000))
        self.controls.session_changed.connect(lambda *_: self._own_settings())
        self.controls.session_changed.connect(self.lifecycle.restart)
        self.controls.preset_chosen.connect(self.lifecycle.apply_preset)
        self.controls.view_changed.connect(self.renderer.request_render)

    # --- the parts' verbs other modules call on the window (the tour, pagevis.gui.launch) ----------------
    def start(self, blocking: bool = False) -> None:
        """Start a session with the configuration the controls show (pagevis.gui.session.lifecycle)."""
        self.lifecycle.start(blocking)

    def restart(self, reason: str = "reset", blocking: bool = False) -> None:
        self.lifecycle.restart(reason, blocking)

    def apply_preset(self, preset) -> None:
        self.lifecycle.apply_preset(preset)

    def open_ab(self, config_a=None, config_b=None, prompt: str | None = None, title: str = "",
                blocking: bool = False, play: bool = False, text: str | None = None):
        return self.lifecycle.open_ab(config_a, config_b, prompt, title, blocking, play, text)

    def open_trace(self, path: str) -> bool:
        return self.lifecycle.open_trace(path)

    def toggle_play(self) -> None:
        self.lifecycle.toggle_play()

    def step(self) -> None:
        """→: the next recorded step, or at the newest decode one token (pagevis.gui.widgets.transport)."""
        self.cursor.step()

    def scrub(self, index: int) -> None:
        self.cursor.scrub(index)

    def redraw(self) -> None:
        """Show the record at `index` in the views now (pagevis.gui.session.rendering)."""
        self.renderer.redraw()

    def open_sequences(self):
        return self.files.open_sequences()

    def open_server(self, preset=None):
        return self.files.open_server(preset)

    def start_tour(self):
        return self.files.start_tour()

    # --- transport -------------------------------------------------------------------------------
    def _records_arrived(self, records: list) -> None:
        if self.follow and self.timeline is not None:
            self.index = len(self.timeline) - 1
        self.renderer.request_render()

    def _state_changed(self, state: str) -> None:
        self.transport.set_playing(state == "running" and self.runner.running)
        if state != "running":
            self.renderer.request_render()  # views that refresh slowly while decoding catch up
        self.status_state.setText(state)
        self.transport.step_action.setEnabled(state not in ("loading", "idle"))
        self.transport.play_action.setEnabled(state not in ("loading", "idle"))
        if state == "done" and self.runner.session is not None:
            if self.follow and self.timeline is not None:  # the last step drawn before "Finished" is said
                self.index = len(self.timeline) - 1
                self.redraw()
            self.statusBar().showMessage(f"Finished: {self.runner.session.stop_reason}", 5000)

    def _failed(self, message: str, trace: str) -> None:
        self.report(message, trace)

    def report(self, message: str, detail: str = "") -> None:
        """Show a problem without blocking: one line in the status bar and the Messages panel (raised), the
        traceback (if any) behind the panel's Details toggle."""
        self.messages.report(message, detail)
        self.statusBar().showMessage(message.strip().partition("\n")[0], 15000)
        dock = self.docks["Messages"]
        events = self.docks["Eviction events"]
        screen = self.screen()
        if (not dock.isVisible() and events.isVisible() and screen is not None
                and screen.availableGeometry().height() <= SMALL_HEIGHT):
            # a row of its own below the docks grew the window past a 1280 × 720 screen: a tab beside the events
            self.tabifyDockWidget(events, dock)
        dock.show()
        dock.raise_()

    # --- settings and closing ----------------------------------------------------------------------
    def _own_settings(self) -> None:
        """The user changed a setting: the session is theirs now (no longer a preset's), and saved on close."""
        self.session_source = "own"
        self.presets.settings_changed()

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
                self.restored_config = True
            except (ValueError, TypeError):
                pass
        return bool(restored)

    def save_settings(self) -> None:
        """The layout, and the configuration if it is the user's own (session_source "own": restored, given as
        flags or changed by hand): a preset's ("preset") or a replay's ("trace") session never replaces it, so a
        plain launch opens the user's last settings, or the defaults."""
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState(SETTINGS_VERSION))
        s.setValue("window/presentation", self.presentation)
        if self.session_source == "own":
            try:
                s.setValue("session/config", json.dumps(self.controls.to_dict()))
            except (ConfigError, ValueError):
                pass
        s.sync()

    def apply_arguments(self, spec: ModelSpec | None, prompt: str | None, config: SessionConfig | None) -> None:
        self.controls.set_configuration(spec, prompt, config)

    def closeEvent(self, event) -> None:
        self.renderer.stop()
        self.lifecycle.replay_timer.stop()
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

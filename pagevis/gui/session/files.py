"""The main window's files and other windows (a part the window holds, `window.files`): open a model or a trace,
save the trace (on a worker thread, confirmed), export views, events, metrics, a recording or an HTML page, and open
the Sequences, Server, Attach windows and the tour beside the main window."""

from __future__ import annotations

from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox, QWidget

from pagevis.kvcache import ConfigError
from pagevis.gui.session.presets import model_title
from pagevis.gui.widgets import export
from pagevis.gui.widgets.windows import place_beside
from pagevis.viewmodel.timeline import kv_layout


class FileActions:
    """The File menu and the windows opened beside the main window. It reads the window's timeline, index, runner,
    controls and preset titles, shows the view state the window's renderer gives, and speaks through the window's
    status bar and `report`; it holds what it opened (sequences_window, server_window, attach_window, tour) and the
    trace writers still running (`savers`)."""

    def __init__(self, window):
        self.window = window
        self.sequences_window = self.server_window = self.attach_window = None
        self.tour = None  # Help ▸ Tour, once started
        self.saved_box: QMessageBox | None = None  # "Trace saved", once a trace was saved from the dialog
        self.savers: list = []  # workers writing traces, each kept until it finishes

    def _say(self, text: str, ms: int = 0) -> None:
        self.window.statusBar().showMessage(text, ms)

    def open_sequences(self):
        """A window decoding many sequences of the current model and prompt over one shared pool."""
        from pagevis.gui.sequences.window import SequencesWindow

        w = self.window
        if w.runner.model is None:
            self._say("Load a model first (start decoding once), then open the sequences view", 8000)
            return None
        try:
            config = w.controls.session_config()
        except (ConfigError, ValueError) as error:
            self._say(f"Sequences view: {error}", 8000)
            return None
        self.sequences_window = SequencesWindow(w.runner.model, config, w.controls.prompt(), w)
        place_beside(self.sequences_window, w, steps=2)
        self.sequences_window.show()
        return self.sequences_window

    def open_server(self, preset=None):
        """The Server window: the current model serving arriving requests (docs/server-window.md)."""
        from pagevis.presets import SERVER_PRESETS
        from pagevis.gui.server.window import ServerWindow

        w = self.window
        if w.runner.model is None:
            self._say("Load a model first (start decoding once), then open the server", 8000)
            return None
        label = model_title(w.runner.spec.label, w.presets.titles) if w.runner.spec is not None else ""
        self.server_window = ServerWindow(w.runner.model, preset or SERVER_PRESETS[0], w, model_label=label,
                                          autorun=True)
        place_beside(self.server_window, w, steps=3)
        self.server_window.show()
        return self.server_window

    def start_tour(self):
        """Help ▸ Tour: the StreamingLLM A/B, then Sequences, then the Server window (gui/session/tour.py)."""
        from pagevis.gui.session.tour import Tour

        self.tour = Tour(self.window)
        self.tour.start()
        return self.tour

    def open_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Open a Llama-family GGUF model", "",
                                              "GGUF models (*.gguf)")
        if path:
            self.window.controls.state.set_gguf(path)

    def choose_trace(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Open a pagevis trace", "", "pagevis traces (*)")
        if path:
            self.window.open_trace(path)

    def _session_file(self, path: str | None, title: str, name: str, kinds: str) -> str | None:
        """Where to write the session: `path`, or the user's choice; None (said) before the first step."""
        if self.window.timeline is None or not len(self.window.timeline):
            self._say("Nothing to save yet: decode a step first", 5000)
            return None
        return path or QFileDialog.getSaveFileName(self.window, title, name, kinds)[0] or None

    def save_trace(self, path: str | None = None, blocking: bool | None = None) -> str | None:
        """Write the shown session's records to a trace file (File ▸ Open trace replays it). Chosen in the
        dialog, the file is written on a worker thread (an 11.6 MB trace held the window 1.5 s) and a message
        confirms it; given a `path` (scripts, tests), it is written before this returns (`blocking`)."""
        blocking = path is not None if blocking is None else blocking
        path = self._session_file(path, "Save trace", "session.pvtrace", "pagevis traces (*.pvtrace)")
        if not path:
            return None
        from pagevis.trace import write_trace

        trace, steps, report = self._trace_of_timeline(), len(self.window.timeline), self.window.report
        if blocking:
            try:
                size = write_trace(path, trace)
            except (OSError, ValueError) as error:
                report(f"Could not save the trace to {path}: {error}")
                return None
            self.trace_saved(path, steps, size, confirm=False)
            return path
        from superqt.utils import create_worker

        self._say(f"Saving {steps} steps to {path}…")
        worker = create_worker(write_trace, path, trace, _start_thread=False, _ignore_errors=True)
        worker.returned.connect(lambda size: self.trace_saved(path, steps, size))
        worker.errored.connect(lambda error: report(f"Could not save the trace to {path}: {error}"))
        worker.finished.connect(lambda: self.savers.remove(worker))
        self.savers.append(worker)  # kept until it finishes
        worker.start()
        return path

    def _trace_of_timeline(self):
        """The shown session as a Trace (its records, token texts, model, stop reason and text)."""
        from pagevis.trace import Trace

        timeline, runner = self.window.timeline, self.window.runner
        records = list(timeline.records)
        ids = set(timeline.info.prompt_ids)
        for record in records:
            ids.update(record.token_ids)
            ids.update([record.next_token] if record.next_token >= 0 else [])
        session = runner.session if runner.timeline is timeline else None
        return Trace(model_label=timeline.info.model_label, prompt=timeline.info.prompt, config=timeline.info.config,
                     prompt_ids=tuple(timeline.info.prompt_ids), records=records,
                     token_texts={int(t): timeline.token_text(int(t)) for t in sorted(ids)},
                     model_spec=runner.timeline_spec if runner.timeline is timeline else None,
                     stop_reason=session.stop_reason if session is not None else None,
                     text=session.text() if session is not None else "", meta={"command": "pagevis (app)"},
                     kv_layout=kv_layout(timeline.info))

    def trace_saved(self, path: str, steps: int, size: int, confirm: bool = True) -> None:
        """Say that the trace is written; with `confirm` (saved from the dialog), also in a box that does not block."""
        text = f"Saved {steps} steps to {path} ({size / (1 << 20):.1f} MB)"
        self._say(text, 10000)
        if confirm:  # not modal: the window goes on playing behind it
            self.saved_box = QMessageBox(QMessageBox.Information, "Trace saved",
                                         f"{text}.\nFile ▸ Open trace… (or `pagevis replay FILE`) replays it.",
                                         QMessageBox.Ok, self.window)
            self.saved_box.setModal(False)
            self.saved_box.show()

    def export_view(self, view: QWidget | None, path: str | None = None) -> str | None:
        if path is None:
            name = "window" if view is None else view.title.lower().replace(" ", "-")
            path, _ = QFileDialog.getSaveFileName(self.window, "Export view", f"{name}.png",
                                                  "PNG image (*.png);;SVG (*.svg)")
        if not path:
            return None
        if view is not None:
            view.show_state(self.window.renderer.view_state())  # a view behind a tab has not been drawn yet
        target = self.window if view is None else view.export_target()
        export.save_widget(target, path)
        self._say(f"Saved {path}", 5000)
        return path

    def export_events(self, path: str | None = None) -> str | None:
        timeline = self.window.timeline
        if timeline is None:
            return None
        path = path or QFileDialog.getSaveFileName(self.window, "Export eviction events", "evictions.csv",
                                                   "CSV (*.csv)")[0]
        if path:
            rows = export.save_events_csv(timeline, path, self.window.index)
            self._say(f"Saved {rows} events to {path}", 5000)
        return path or None

    def export_metrics(self, path: str | None = None) -> str | None:
        timeline = self.window.timeline
        if timeline is None:
            return None
        path = path or QFileDialog.getSaveFileName(self.window, "Export metrics", "metrics.csv", "CSV (*.csv)")[0]
        if path:
            rows = export.save_metrics_csv(timeline, path)
            self._say(f"Saved {rows} steps to {path}", 5000)
        return path or None

    def export_recording(self, choice=None):
        """The recorded steps (or the A/B or Server window) to a video (pagevis.gui.widgets.recording)."""
        from pagevis.gui.widgets.recording import export_recording

        return export_recording(self.window, choice)

    def export_html(self, path: str | None = None) -> str | None:
        """The session as one HTML page anyone can open (pagevis.export.html), at the selected layer."""
        path = self._session_file(path, "Export HTML page", "session.html", "HTML (*.html)")
        if not path:
            return None
        from pagevis.export.html import HtmlExportError, write_html

        layer, timeline = self.window.renderer.view_state().layer, self.window.timeline
        try:
            size = write_html(path, timeline, layer)
        except (HtmlExportError, OSError) as error:
            self.window.report(f"Could not export {path}: {error}")
            return None
        self._say(f"Saved {len(timeline)} steps of layer {layer} to {path} ({size / 1024:.0f} KiB)", 6000)
        return path

    def open_attach(self, endpoints: str | None = None):
        """View ▸ Attach: the attach window on a running engine's KV events (vLLM, SGLang, `pagevis serve`),
        endpoints asked for (e.g. tcp://HOST:5557); as `pagevis attach ENDPOINT` opens it."""
        from pagevis.attach.subscriber import parse_source

        if endpoints is None:
            endpoints, ok = QInputDialog.getText(self.window, "Attach to an engine's KV events",
                                                 "ZMQ endpoint(s), comma-separated (e.g. tcp://127.0.0.1:5557):")
            if not ok or not endpoints.strip():
                return None
        try:
            sources = [parse_source(text.strip()) for text in endpoints.split(",") if text.strip()]
        except ValueError as error:
            self._say(f"Attach: {error}", 8000)
            return None
        return self.show_attach(sources=sources)

    def open_attach_recording(self, path: str | None = None):
        """View ▸ Attach: play a KV-event recording (`pagevis attach --record FILE` makes one)."""
        from pagevis.attach.playback import Playback
        from pagevis.attach.recording import RecordingError, read_recording

        path = path or QFileDialog.getOpenFileName(self.window, "Play a KV-event recording", "",
                                                   "KV-event recordings (*.kvev);;All files (*)")[0]
        if not path:
            return None
        try:
            playback = Playback(read_recording(path))
        except (RecordingError, OSError) as error:
            self.window.report(f"Could not play {path}: {error}")
            return None
        return self.show_attach(playback=playback)

    def show_attach(self, sources=(), playback=None):
        """The attach window on `sources` (endpoints) or a recording's `playback`, beside the main window."""
        from pagevis.gui.attach.window import open_window

        self.attach_window = open_window(sources=sources, playback=playback)
        place_beside(self.attach_window, self.window, steps=4)
        self.attach_window.show()
        self.attach_window.start()
        return self.attach_window

    def show_shortcuts(self) -> None:
        box = QMessageBox(QMessageBox.Information, "Keyboard shortcuts",
                          "Space: play / pause\n→: next recorded step, or at the newest decode one token\n"
                          "← or Ctrl+←: previous step\nCtrl+→: next recorded step\nHome / End: first / latest step\n"
                          "Ctrl+R: reset the session\nCtrl+Z: back to the previous run (kept on every restart)\n"
                          "Ctrl+Return (in the prompt): restart with the prompt\n"
                          "F5: the presentation layout\nF11: full screen\nCtrl+↑ / Ctrl+↓: next / previous layer",
                          QMessageBox.Ok, self.window)
        box.setModal(False)
        box.show()

"""The main window's session lifecycle (a part of MainWindow, by job): start and restart, presets and the A/B
window, replays and the previous run, and what a new session changes in the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtWidgets import QMessageBox

from pagevis.kvcache import ConfigError
from pagevis.kvcache.layer_spec import layer_specs
from pagevis.gui.session.presets import model_title
from pagevis.gui.session.rendering import memory_text
from pagevis.gui.widgets.windows import place_beside
from pagevis.viewmodel.timeline import Timeline


class SessionLifecycle:
    """MainWindow's sessions (a mixin: it drives the window's runner, controls, presets and status bar)."""

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
        self.renderer.new_session()
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
        weights = getattr(getattr(self.runner.session, "model", None), "weight_info", None)
        self.model_status = (title, weights_text(weights) if weights and self.runner.state != "replay" else "",
                             info.model_label)
        self.fit_model_status()
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
        elif self.start_note:  # the first session: whose settings these are
            self.statusBar().showMessage(self.start_note, 12000)
        self.start_note = ""
        self.transport.previous_action.setEnabled(previous is not None)
        reason, self._restart_reason = self._restart_reason, ""
        self.renderer.request_render()
        self.presets.session_started(reason)

    def fit_model_status(self) -> None:
        """The status bar's model: its name, and its weights (types and size) where the window is wide enough
        for them beside a restart message (at 1280 px they clipped it); the tooltip always has both."""
        if not hasattr(self, "status_model"):  # a resize while the window is being built
            return
        title, weights, label = self.model_status
        wide = self.width() >= WIDE_STATUS and not self.presentation
        self.status_model.setText(f"{title} · {weights}" if weights and wide else title)
        self.status_model.setToolTip(label + (f"\nweights: {weights}" if weights else ""))

    def open_trace(self, path: str) -> bool:
        try:
            from pagevis.trace import TraceError, read_trace
        except ImportError:
            self.report("Traces cannot be opened yet: pagevis.trace is not available in this installation.")
            return False
        try:
            trace = read_trace(path)
        except (TraceError, OSError, ValueError, MemoryError) as error:
            self.report(f"Could not open trace {path}: {error}")
            return False
        self.runner.replay(trace)
        self.session_source = "trace"  # a replay's settings are not the user's to save
        self.setWindowTitle(f"pagevis — replay of {Path(path).name} ({model_title(trace.model_label)})")
        self.controls.set_configuration(prompt=trace.prompt, config=trace.config)
        self.scrub(0)
        self.statusBar().showMessage(f"Replaying {Path(path).name}: {len(trace.records)} steps "
                                     f"(play animates them; Reset returns to live decoding)", 8000)
        return True


WIDE_STATUS = 1600  # windows at least this wide name the model's weights in the status bar


def weights_text(weights: dict) -> str:
    """The status bar's word on the weights: 'Q4_1+Q8_0 · 112 MB' (as the file stores them) or 'float32 · 651 MB'."""
    size = f"{weights['bytes'] / 1e6:.0f} MB"
    if weights["format"] != "quantized":
        return f"float32 · {size}"
    types = [t for t in weights["types"] if t not in ("F32", "F16", "BF16")] or ["F32"]
    return f"{'+'.join(types)} · {size}"

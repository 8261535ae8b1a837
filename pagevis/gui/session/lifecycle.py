"""The main window's sessions (the SessionLifecycle it holds): start and restart, presets and the A/B window,
replays (opened, played, left) and the previous run, and what a new session changes in the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QMessageBox

from pagevis.kvcache import ConfigError
from pagevis.kvcache.layer_spec import layer_specs
from pagevis.gui.session.presets import model_title
from pagevis.gui.session.rendering import memory_text
from pagevis.gui.widgets.windows import place_beside
from pagevis.viewmodel.timeline import Timeline


class SessionLifecycle:
    """The window's sessions (a part the window holds, `window.lifecycle`): it drives the window's runner from its
    controls and presets, sets the window's timeline and index when a session starts, its title and status bar,
    opens the A/B window (`window.ab_window`), and plays a replay on its own timer."""

    def __init__(self, window):
        self.window = window
        self._restart_reason = ""  # why the session restarts, said once it has
        self.model_status = ("no model", "", "")  # the status bar's model: (name, weights, file or label)
        self.replay_timer = QTimer(window, interval=100)  # a replay's play: one recorded step a tick
        self.replay_timer.timeout.connect(self._replay_tick)

    def _say(self, text: str, ms: int) -> None:
        self.window.statusBar().showMessage(text, ms)

    def start(self, blocking: bool = False) -> None:
        """Start a session with the configuration the controls show."""
        self.restart("", blocking=blocking)

    def restart(self, reason: str = "reset", blocking: bool = False) -> None:
        w = self.window
        try:
            config = w.controls.session_config()
        except (ConfigError, ValueError) as error:
            self._say(f"Not restarted: {error}", 8000)
            return
        if w.runner.state == "replay" and not self.leave_replay(reason):
            return
        self.replay_timer.stop()
        self._restart_reason = reason
        self.clear_messages()
        w.runner.configure(w.controls.model_spec(), w.controls.prompt(), config, blocking=blocking)

    def apply_preset(self, preset) -> None:
        """The preset's settings, its point in the banner, playing (pagevis.gui.session.presets)."""
        self.window.presets.apply(preset)

    def open_ab(self, config_a=None, config_b=None, prompt: str | None = None, title: str = "",
                blocking: bool = False, play: bool = False, text: str | None = None):
        """Open the A/B window: by default A is the controls' configuration and B the same cache with the
        other of sinks / oldest (the StreamingLLM comparison). With `play` (a preset), both sides decode
        once the model is ready."""
        from pagevis.gui.ab.window import ABWindow

        w = self.window
        try:
            config_a = config_a or w.controls.session_config()
        except (ConfigError, ValueError) as error:
            self._say(f"No A/B: {error}", 8000)
            return None
        if config_b is None:
            config_b = replace(config_a, policy="oldest" if config_a.policy != "oldest" else "sinks", policy_params={})
        if w.ab_window is not None:
            w.ab_window.close()
        w.ab_window = ABWindow(w.controls.model_spec(), prompt or w.controls.prompt(), config_a, config_b,
                               title=title, text=text)
        place_beside(w.ab_window, w)
        w.ab_window.show()
        w.ab_window.start(blocking=blocking, play=play)
        return w.ab_window

    def toggle_play(self) -> None:
        """Play or pause: the decoder, or in a replay the replay's timer (from the start once at its end)."""
        w = self.window
        if w.runner.state == "replay":
            if self.replay_timer.isActive():
                self.replay_timer.stop()
            else:
                if w.index >= len(w.timeline) - 1:
                    w.scrub(0)
                self.replay_timer.start()
            w.transport.set_playing(self.replay_timer.isActive())
            return
        if w.runner.running:
            w.runner.stop()
        else:
            w.follow = True
            w.runner.play()

    def _replay_tick(self) -> None:
        w = self.window
        if w.timeline is None or w.index >= len(w.timeline) - 1:
            self.replay_timer.stop()
            w.transport.set_playing(False)
            return
        w.scrub(w.index + 1)

    def speed_changed(self, seconds: float) -> None:
        """The transport's speed: the decoder's pause between steps, and a replay's."""
        self.window.runner.set_interval(seconds)
        self.replay_timer.setInterval(int(max(seconds, 1 / 30) * 1000))

    def leave_replay(self, reason: str) -> bool:
        """Ask before a change ends the replay; on no, the controls show the replay's settings again."""
        w = self.window
        name = w.timeline.info.model_label if w.timeline is not None else "the trace"
        if self.confirm("Leave the replay?", f"{reason[:1].upper()}{reason[1:]}: start a live session and leave the "
                        f"replay of {name}? (Decode ▸ Back to previous run returns to it.)"):
            return True
        info = w.timeline.info
        w.controls.set_configuration(prompt=info.prompt, config=info.config)
        self._say("Still replaying: nothing changed", 5000)
        return False

    def confirm(self, title: str, question: str) -> bool:
        answer = QMessageBox.question(self.window, title, question, QMessageBox.Yes | QMessageBox.No,
                                      QMessageBox.Yes)
        return answer == QMessageBox.Yes

    def back_to_previous(self) -> None:
        """Swap the current session with the previous one (kept on every restart), both still resumable."""
        runner = self.window.runner
        if runner.busy:
            runner.stop()
            self._say("Paused: press Ctrl+Z again to return to the previous run", 5000)
            return
        if not runner.swap_previous():
            self._say("No previous run to return to", 4000)
            return
        self.window.controls.set_configuration(runner.spec, runner.prompt, runner.config)
        self._say(f"Back to the previous run ({len(runner.timeline)} steps); Ctrl+Z swaps again", 6000)

    def clear_messages(self) -> None:
        """Messages belong to the session that produced them: a new one starts with none."""
        self.window.messages.clear()
        self.window.docks["Messages"].hide()

    def session_started(self, timeline: Timeline) -> None:
        w = self.window
        w.timeline = timeline
        w.index, w.follow = -1, True
        w.renderer.new_session()
        info = timeline.info
        w.controls.set_model_shape(info.n_layers, info.n_heads, info.n_kv_heads,
                                   [spec.label for spec in layer_specs(info.sliding_windows, info.n_layers)]
                                   if info.sliding_windows is not None else None)
        saved_layer = w.controls.state.take_saved_layer()
        if saved_layer is not None:
            w.controls.layer.setValue(min(saved_layer, info.n_layers - 1))
        if len(timeline):
            w.index = len(timeline) - 1
        w.statusBar().clearMessage()
        title = model_title(info.model_label, w.presets.titles)
        replaying = w.runner.state == "replay"
        w.setWindowTitle(f"pagevis — {title}, replay" if replaying else f"pagevis — {title}, paged KV cache, live")
        weights = getattr(getattr(w.runner.session, "model", None), "weight_info", None)
        self.model_status = (title, weights_text(weights) if weights and not replaying else "", info.model_label)
        self.fit_model_status()
        w.status_memory.setText(memory_text(info.cache_bytes, info.n_kv_heads, info.config.dtype,
                                            info.kv_bytes_per_token, info.storage_notice))
        w.status_memory.setToolTip(f"K/V storage, all layers, one sequence at capacity: {info.storage}"
                                   if info.storage else "")
        self._say_started(w.runner.previous)
        reason, self._restart_reason = self._restart_reason, ""
        w.renderer.request_render()
        w.presets.session_started(reason)

    def _say_started(self, previous) -> None:
        """The status bar's word on a new session: why it restarted (and that Ctrl+Z returns to the run before), or
        the first session's note on whose settings these are."""
        w = self.window
        if self._restart_reason:
            # short enough for the status bar of a 1280-px window beside its permanent fields
            kept = f" · Ctrl+Z: the previous run ({len(previous.timeline)} steps)" if previous is not None else ""
            self._say(f"{self._restart_reason[0].upper()}{self._restart_reason[1:]}: restarted{kept}", 8000)
        elif w.start_note:  # the first session: whose settings these are
            self._say(w.start_note, 12000)
        w.start_note = ""
        w.transport.previous_action.setEnabled(previous is not None)

    def fit_model_status(self) -> None:
        """The status bar's model: its name, and its weights (types and size) where the window is wide enough
        for them beside a restart message (at 1280 px they clipped it); the tooltip always has both."""
        w = self.window
        if not hasattr(w, "status_model"):  # a resize while the window is being built
            return
        title, weights, label = self.model_status
        wide = w.width() >= WIDE_STATUS and not w.presentation
        w.status_model.setText(f"{title} · {weights}" if weights and wide else title)
        w.status_model.setToolTip(label + (f"\nweights: {weights}" if weights else ""))

    def open_trace(self, path: str) -> bool:
        w = self.window
        try:
            from pagevis.trace import TraceError, read_trace
        except ImportError:
            w.report("Traces cannot be opened yet: pagevis.trace is not available in this installation.")
            return False
        try:
            trace = read_trace(path)
        except (TraceError, OSError, ValueError, MemoryError) as error:
            w.report(f"Could not open trace {path}: {error}")
            return False
        w.runner.replay(trace)
        w.session_source = "trace"  # a replay's settings are not the user's to save
        w.setWindowTitle(f"pagevis — replay of {Path(path).name} ({model_title(trace.model_label)})")
        w.controls.set_configuration(prompt=trace.prompt, config=trace.config)
        w.scrub(0)
        self._say(f"Replaying {Path(path).name}: {len(trace.records)} steps "
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

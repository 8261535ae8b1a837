"""The main window's rendering (the Renderer it holds): the view state, frames paced so the UI thread leaves the
decoder its share of the GIL (and the worker's hand-offs with them), the slow views in turns (one a frame), the
transport, narration and status bar; and the status bar's memory texts."""

from __future__ import annotations

import time

import numpy as np
from PySide6.QtCore import QTimer

from pagevis.kvcache import ConfigError
from pagevis.kvcache.memory import hybrid_bytes
from pagevis.kvcache.layer_spec import layer_specs
from pagevis.viewmodel.narration import narrate
from pagevis.viewmodel.view_state import ViewState

FRAME_INTERVAL = 1 / 30  # redraw at most this often, however fast records arrive
MAX_FRAME_INTERVAL = 1 / 5  # ... and at least this often while records arrive
FIRST_FRAME_INTERVAL = 1 / 10  # the pace a run starts at, until the first measure (PACE_WINDOW) sets it
PACE_WINDOW = 0.25  # seconds of CPU time the pace is measured over
UI_SHARE = 0.06  # while decoding at max speed, the UI thread (records arriving, redraws, painting: everything) may
# use this share of the decoding's CPU time. Its Python holds the GIL the worker needs, and on a busy machine its
# CPU is the worker's too: at a share of the wall clock (0.12), SmolLM2's default session drew 12-14 frames a second
# at 5-8 ms each and the app decoded at 0.56-0.84x its headless rate with 14-17 ms of CPU a step against 9
# (load 3-5; python -m pagevis.bench.gui.app --app-defaults). Only at max speed: see request_render.
STATUS_INTERVAL = 0.25  # while decoding, the status bar's step and speed change at most this often

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


class Renderer:
    """The main window's drawing (a part the window holds, `window.renderer`): it reads the window's timeline,
    index, runner and controls, draws the window's views (in their docks) and sets its transport, narration and
    status bar; it owns the frame pacing (its timers, when each view last drew) and counts the redraws (`frames`,
    which the benchmark reads)."""

    def __init__(self, window):
        self.window = window
        self.frames = 0  # redraws so far
        self._last_frame = 0.0
        self._shown_at: dict[str, float] = {}  # when each view last rendered
        self._status_at = 0.0  # when the status bar's step and speed were last set
        self._interval = FIRST_FRAME_INTERVAL  # the current pace of redraws while decoding (see _pace)
        self._cpu_mark = (time.perf_counter(), time.thread_time(), time.process_time(), 0)
        self._frame_timer = QTimer(window, singleShot=True)
        self._frame_timer.timeout.connect(self.redraw)

    def stop(self) -> None:
        """No more frames (the window closes)."""
        self._frame_timer.stop()

    def new_session(self) -> None:
        """A new session's first record sets the status bar at once."""
        self._status_at = 0.0

    def view_state(self) -> ViewState:
        w = self.window
        options = w.controls.view_options()
        if w.timeline is not None:
            options["layer"] = min(options["layer"], w.timeline.info.n_layers - 1)
            if options["head"] is not None and options["head"] >= w.timeline.info.n_heads:
                options["head"] = None
        loading = None
        if w.timeline is None and w.runner.state == "loading":
            try:  # the pool the loading session will have, shown while the model loads
                loading = w.controls.session_config()
            except (ConfigError, ValueError):
                pass
        return ViewState(w.timeline, w.index, loading=loading, **options)

    def request_render(self) -> None:
        """Redraw soon: at once if the last frame is older than FRAME_INTERVAL, else when it is."""
        if self._frame_timer.isActive():
            return
        # at max speed the pace keeps the UI's share of the GIL down; at a chosen playback speed the decoder
        # waits between steps anyway, and every step gets its frame
        runner = self.window.runner
        interval = self._pace() if runner.running and not runner.interval else FRAME_INTERVAL
        wait = self._last_frame + interval - time.perf_counter()
        self._frame_timer.start(max(0, int(wait * 1000)))

    def redraw(self) -> None:
        """Show the selected record in every visible view. While decoding runs, the views that are watched
        (page grid, attention) draw in every frame, and of the others (each at most as often as its
        `live_interval`) the one waiting longest whose turn came: one paint of the window a frame, and no frame
        paints every view, so input never waits for a full repaint. Once decoding stops, every view shows the
        selected record."""
        self._frame_timer.stop()
        self._last_frame = time.perf_counter()
        self.frames += 1
        state = self.view_state()
        now, views = time.perf_counter(), self.window.views
        if not self.window.runner.running:
            self._show(views, state, now)
        else:
            self._show([v for v in views if not getattr(v, "live_interval", 0.0)], state, now)
            self._show(self._slow_view_due(now), state, now)
        self._update_transport(state)

    def _slow_view_due(self, now: float) -> list:
        """While decoding: the slow view waiting longest, if its turn came ([] if none)."""
        slow = [v for v in self.window.views if getattr(v, "live_interval", 0.0) and self._shown(v)]
        due = [v for v in slow if now - self._shown_at.get(v.title, 0.0) >= v.live_interval]
        return [min(due, key=lambda v: self._shown_at.get(v.title, 0.0))] if due else []

    def _shown(self, view) -> bool:
        """Should the view be drawn? Not when its dock is closed; a costly view (`only_when_visible`) not
        either while it is behind another dock's tab (Qt keeps such a dock 'visible' but off the window):
        it is drawn when its tab is raised."""
        dock = self.window.docks[view.title]
        if dock.isHidden():
            return False
        return not (getattr(view, "only_when_visible", False) and self.window.isVisible()
                    and dock.visibleRegion().isEmpty())

    def _show(self, views, state: ViewState, now: float) -> None:
        for view in views:
            if self._shown(view):
                self._shown_at[view.title] = now
                view.show_state(state)

    def _pace(self) -> float:
        """Seconds between redraws while decoding: what keeps the UI thread's CPU time (arrivals, redraws,
        painting, everything, charged to the frames) near UI_SHARE of the decoding's (the process's other
        threads), between 30 and 5 frames a second. On a small or busy machine the decoder keeps its speed and
        the screen gets fewer frames. A mark older than a second (a pause) starts a new measure."""
        wall, cpu, total = time.perf_counter(), time.thread_time(), time.process_time()
        since_wall, since_cpu, since_total, since_frames = self._cpu_mark
        elapsed, frames = wall - since_wall, self.frames - since_frames
        if elapsed >= 1.0 or (elapsed >= PACE_WINDOW and frames):
            ui = cpu - since_cpu
            decoder = total - since_total - ui
            if elapsed < 1.0 and decoder > 0:
                allowed = UI_SHARE * decoder / elapsed  # UI seconds a second
                self._interval = min(max(ui / frames / allowed, FRAME_INTERVAL), MAX_FRAME_INTERVAL)
                # records are handed over twice a frame: each hand-off costs the UI thread too (SessionRunner)
                self.window.runner.hand_every = self._interval / 2
            self._cpu_mark = (wall, cpu, total, self.frames)
        return self._interval

    def _update_transport(self, state: ViewState) -> None:
        w, timeline, record = self.window, state.timeline, state.record
        count = len(timeline) if timeline is not None else 0
        if record is None:
            w.transport.set_range(0, 0, "no steps yet" if timeline is not None else "no session")
            w.transport.slider.set_marks(np.zeros(0))
            w.narration.setText("Press Space to play, → to decode one token" if timeline is not None else "")
            w.status_step.fit("step —")  # (narrower again: the room for the status bar's messages)
            w.status_speed.fit("— tok/s")  # not the previous run's speed
            return
        label = f"step {state.index} / {count - 1} · {record.kind}"
        w.transport.set_range(count, state.index, label)
        w.transport.slider.set_marks(timeline.eviction_steps())
        w.narration.setText(narrate(record, state.layer, timeline.position_text, timeline.info.config.policy))
        now = time.perf_counter()
        if w.runner.running and now - self._status_at < STATUS_INTERVAL:
            return  # the status bar repeats the transport's step and is read, not watched: 4× a second
        self._status_at = now
        w.status_step.setText(f"step {state.index}: {record.kind} of {len(record.token_ids)} token"
                              f"{'s' if len(record.token_ids) != 1 else ''}")
        speed = timeline.tokens_per_second(state.index)
        w.status_speed.setText(f"{speed:.1f} tok/s" if speed == speed else "— tok/s")
        info = timeline.info
        if info.sliding_windows is not None and info.page_bytes:
            w.status_memory.setText(hybrid_memory_text(info, record))

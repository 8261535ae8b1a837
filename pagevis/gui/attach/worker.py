"""The attach window's threads. The UI thread never touches the state: it pulls the latest frames these threads
made, on a timer (attach_window.py).

- `FleetWorker` owns the source: a live `Attacher` (its ZMQ sockets live and die on this thread) or a recorded
  `Playback` scrubbed to `target`. Between polls it publishes a `FleetFrame` (snapshots without blocks:
  counters, rates, lifetimes, hot prefixes) at most 30 times a second (20 live), and hands a full snapshot (with
  blocks) to the forest worker whenever that one is idle and the state has changed.
- `ForestWorker` turns a full snapshot into the forest (attach_model.build_forest, forest_layout.layout_forest,
  prefix_forest.prepare_drawing: the UI thread only swaps the drawing in) and the overlap between engines. It
  waits twice as long as its last build took before taking the next one, and at least `min_interval_s` (the
  window asks for 0.25 s live), so at 1 M blocks it holds the GIL a third of the time at most and the forest
  updates every few seconds.
- `MetricsWorker` scrapes `--metrics URL` once a second.
Each stops when asked (`stop()`: requestInterruption + wait); nothing here raises into the UI: errors become text
in the frames.

Garbage collection (`GcFreezer`): CPython 3.11 runs a full collection whenever a quarter more objects have
survived into the oldest generation, and the frames made 30 times a second get there; each full collection then
traverses every object of the process (Qt, pyqtgraph, the state's million-element lists: 40-180 ms measured,
holding the GIL, so the UI thread waits). And a full snapshot's tuples of a million hashes, parents, tokens and
extras cost the next young collection 66 ms. So the window freezes what exists when it starts (`gc.freeze()`:
moved to the permanent generation, never traversed again), and the fleet worker freezes again after each
snapshot of FREEZE_ROWS rows or more. Frozen objects are still freed by reference counting (the frames are not
cyclic); every UNFREEZE_S (5 minutes) the worker unfreezes and collects once (one pause, 100 ms or more at 1 M
blocks), so cyclic garbage is still reclaimed; closing the window unfreezes.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagevis.attach.metrics import MetricsHistory, scrape
from pagevis.attach.state import FleetSnapshot
from pagevis.viewmodel.attach_forest import EngineForest, Overlap, build_forest, elsewhere, overlap
from pagevis.viewmodel.fleet_frame import EngineLine, FleetFrame
from pagevis.viewmodel.forest_layout import DEFAULT_BUDGET, ForestLayout, Interrupted, layout_forest, subtree
from pagevis.gui.widgets.owned_thread import OwnedThread
from pagevis.gui.widgets.prefix_forest import ForestDrawing, prepare_drawing

FRAME_S = 1 / 30  # light frames at most this often (a playback that moved; forests)
LIVE_FRAME_S = 1 / 20  # live: each light frame is a snapshot made with the GIL held; 20 a second show as much
CHUNK = 2000  # playback messages applied between two looks at the target and the stop flag
MANY_ENGINES = 64  # beyond this many engines, their summary lines are refreshed twice a second only
BUILD_RATIO = 2.0  # after a forest that took t to build, wait 2t: the forest worker holds the GIL a third of the time
FREEZE_ROWS = 100_000  # a full snapshot this large is frozen out of the garbage collector's way (see above)
UNFREEZE_S = 300.0


class GcFreezer:
    """gc.freeze() now and after big snapshots, unfreeze-collect-freeze every `period_s` (see the module docstring)."""

    def __init__(self, period_s: float = UNFREEZE_S):
        self.period_s = period_s
        self.frozen = False
        self.collected_at = time.monotonic()

    def freeze(self) -> None:
        gc.freeze()
        self.frozen = True

    def tick(self) -> None:
        if self.frozen and time.monotonic() - self.collected_at >= self.period_s:
            self.collected_at = time.monotonic()
            gc.unfreeze()
            gc.collect()
            gc.freeze()

    def release(self) -> None:
        if self.frozen:
            self.frozen = False
            gc.unfreeze()


class LiveSource:
    """Endpoints, through pagevis.attach.subscriber.Attacher (created and used on the worker thread only)."""

    live = True

    def __init__(self, sources: list, recorder=None):
        self.sources, self.recorder = list(sources), recorder
        self.attacher = None
        self.fleet = None
        self.position = self.length = None

    def start(self) -> None:
        from pagevis.attach.subscriber import Attacher

        self.attacher = Attacher(self.sources, recorder=self.recorder)
        self.fleet = self.attacher.fleet
        self.attacher.start()

    def step(self) -> None:
        self.attacher.poll(0.01)

    def close(self) -> None:
        if self.attacher is not None:
            self.attacher.close()


class PlaybackSource:
    """A recording (pagevis.attach.playback.Playback), played up to `target` (set from any thread)."""

    live = False

    def __init__(self, playback):
        self.playback = playback
        self.target = 0
        self.length = len(playback)

    @property
    def fleet(self):
        return self.playback.fleet

    @property
    def position(self) -> int:
        return self.playback.position

    def start(self) -> None:
        pass

    def step(self) -> None:
        target = max(0, min(int(self.target), self.length))
        if target < self.playback.position:
            self.playback.seek(0)  # back: rebuilt from the start, then forward in chunks
        if target > self.playback.position:
            self.playback.advance(min(target - self.playback.position, CHUNK))
        else:
            time.sleep(0.005)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ForestFrame:
    forest: EngineForest
    layout: ForestLayout
    drawing: ForestDrawing
    overlap: Overlap
    selected: int
    position: int | None
    build_s: float  # forest rows + layout
    snapshot_s: float  # the full snapshot, on the fleet worker
    focus: tuple | None = None  # (medium, group, hash) whose subtree `drawing` shows; None: the whole forest
    shown_rows: np.ndarray | None = None  # with a focus: the forest rows drawn (drawing row i is forest row [i])


class ForestWorker(OwnedThread):
    def __init__(self, detokenizer=None, budget: int = DEFAULT_BUDGET, min_interval_s: float = 0.0, parent=None):
        super().__init__(parent)
        self.detokenizer, self.budget, self.min_interval_s = detokenizer, budget, min_interval_s
        self.latest: ForestFrame | None = None
        self.error = ""
        self.builds = 0
        self._pending: tuple | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._busy = False
        self._next_at = 0.0
        self._previous: EngineForest | None = None
        self.focus: tuple | None = None  # (medium, group, hash): lay out only that block's subtree

    def idle(self) -> bool:
        return not self._busy and self._pending is None and time.monotonic() >= self._next_at

    def submit(self, snapshot: FleetSnapshot, selected: int, position: int | None, snapshot_s: float) -> None:
        with self._lock:
            self._pending = (snapshot, selected, position, snapshot_s)
            self._busy = True
        self._wake.set()

    def forget(self) -> None:
        """The next forest marks nothing as changed (another engine was selected)."""
        self._previous = None

    def run(self) -> None:
        while not self.isInterruptionRequested():
            if not self._wake.wait(0.05):
                continue
            self._wake.clear()
            with self._lock:
                job, self._pending = self._pending, None
            if job is None:
                self._busy = False
                continue
            began = time.monotonic()
            try:
                self.latest = self._build(*job)
                self.error = ""
            except Interrupted:
                break
            except Exception as error:  # noqa: BLE001 - shown in the window; the next snapshot may do better
                self.error = f"forest: {type(error).__name__}: {error}"[:300]
            finally:
                took = time.monotonic() - began
                self._next_at = time.monotonic() + max(FRAME_S, self.min_interval_s, BUILD_RATIO * took)
                self._busy = False
                self.builds += 1

    def _build(self, snapshot: FleetSnapshot, selected: int, position: int | None, snapshot_s: float) -> ForestFrame:
        began = time.perf_counter()
        table, sets = overlap(snapshot)
        selected = min(selected, len(snapshot.engines) - 1)
        engine = snapshot.engines[selected]
        shared = elsewhere(sets, selected) if len(sets) > 1 else None
        previous = self._previous if self._previous is not None and self._previous.name == engine.name else None
        forest = build_forest(engine, previous, shared, self.detokenizer, position)
        rows, focus, shown = forest.rows, self.focus, None
        if focus is not None:
            row = forest.block_row(focus[2], focus[0], focus[1])
            if row >= 0:
                shown = subtree(rows.parent, row)
                rows = rows.subset(shown)
            else:
                focus = None  # not resident any more: the whole forest
        layout = layout_forest(rows.parent, rows.tokens, rows.order, self.budget, stop=self.isInterruptionRequested)
        drawing = prepare_drawing(rows, layout)
        self._previous = forest
        return ForestFrame(forest, layout, drawing, table, selected, position, time.perf_counter() - began,
                           snapshot_s, focus, shown)

    def stop(self, timeout_ms: int = 5000) -> bool:
        self.requestInterruption()
        self._wake.set()
        return self.wait(timeout_ms)


class FleetWorker(OwnedThread):
    def __init__(self, source, forest: ForestWorker | None = None, freezer: GcFreezer | None = None, parent=None):
        super().__init__(parent)
        self.source, self.forest, self.freezer = source, forest, freezer
        self.selected = 0
        self.latest: FleetFrame | None = None
        self.error = ""
        self.worker_errors = 0
        self.started_source = False
        self._changed_key: Any = None
        self._lines: tuple = ()
        self._lines_at = 0.0

    def run(self) -> None:
        try:
            try:
                self.source.start()
                self.started_source = True
            except Exception as error:  # noqa: BLE001 - zmq.ZMQError for a bad endpoint, and anything else
                self._fail(f"could not attach: {type(error).__name__}: {error}")
            last = 0.0
            while not self.isInterruptionRequested():
                if self.started_source:
                    try:
                        self.source.step()
                    except Exception as error:  # noqa: BLE001 - a bug must not take the window down
                        self._fail(f"{type(error).__name__}: {error}")
                        time.sleep(0.05)
                else:
                    time.sleep(0.05)
                now = time.monotonic()
                if now - last >= (LIVE_FRAME_S if self.source.live else FRAME_S) or self._arrived():
                    self._publish(now)
                    last = now
                self._feed_forest()
        finally:
            try:
                self.source.close()
            except Exception as error:  # noqa: BLE001
                self._fail(f"closing: {error}")

    def _fail(self, text: str) -> None:
        self.worker_errors += 1
        self.error = text[:300]

    def _arrived(self) -> bool:
        """A playback that just reached its target publishes at once (a scrub shows the exact position)."""
        latest = self.latest
        return (not self.source.live and latest is not None and latest.position != self.source.position
                and self.source.position == self.source.target)

    def _publish(self, now: float) -> None:
        fleet = self.source.fleet
        if fleet is None:
            self.latest = FleetFrame((), 0, None, 0, None, self.source.length, False, self.error,
                                     self.worker_errors, now)
            return
        with fleet.lock:
            engines = fleet.engines
            selected = min(self.selected, max(len(engines) - 1, 0))
            refresh = len(engines) <= MANY_ENGINES or now - self._lines_at >= 0.5 or len(self._lines) != len(engines)
            if refresh:
                self._lines = tuple(EngineLine(e.name, e.counters(), e.resident_by_medium()) for e in engines)
                self._lines_at = now
            engine = engines[selected].snapshot(blocks=False) if engines else None
            shared = fleet.shared_gpu_blocks()
            position = self.source.position
        self.latest = FleetFrame(self._lines, selected, engine, shared, position, self.source.length,
                                 self.started_source, self.error, self.worker_errors, now)

    def _feed_forest(self) -> None:
        fleet = self.source.fleet
        if self.forest is None or fleet is None or not self.forest.idle():
            return
        frame = self.latest
        if frame is None:
            return
        key = (frame.selected, frame.position, id(fleet), self.forest.focus,
               tuple((line.counters.batches, line.counters.epoch, line.counters.decode_errors)
                     for line in frame.engines))
        if key == self._changed_key or frame.position != self.source.position:
            return
        began = time.perf_counter()
        with fleet.lock:
            snapshot = fleet.snapshot(blocks=True)
            position = self.source.position
        if self.freezer is not None and sum(len(e.blocks.resident) for e in snapshot.engines) >= FREEZE_ROWS:
            self.freezer.freeze()
        self._changed_key = key
        self.forest.submit(snapshot, frame.selected, position, time.perf_counter() - began)

    def stop(self, timeout_ms: int = 5000) -> bool:
        self.requestInterruption()
        return self.wait(timeout_ms)


class MetricsWorker(OwnedThread):
    """Scrapes `url` every `interval_s`; `samples()` is a copy of what it has, `error` the last failure."""

    scrape = staticmethod(scrape)  # url -> a sample `history.add` takes

    def __init__(self, url: str, interval_s: float = 1.0, parent=None):
        super().__init__(parent)
        self.url, self.interval_s = url, interval_s
        self.history = MetricsHistory()
        self.error = ""
        self.scrapes = 0
        self._lock = threading.Lock()

    def samples(self) -> tuple:
        with self._lock:
            return tuple(self.history.samples)

    def run(self) -> None:
        while not self.isInterruptionRequested():
            began = time.monotonic()
            try:
                sample = self.scrape(self.url)
                with self._lock:
                    self.history.add(sample)
                self.error = ""
            except Exception as error:  # noqa: BLE001 - OSError, ValueError, and anything the parser raises
                self.error = f"{type(error).__name__}: {error}"[:200]
            self.scrapes += 1
            while not self.isInterruptionRequested() and time.monotonic() - began < self.interval_s:
                time.sleep(0.05)

    def stop(self, timeout_ms: int = 5000) -> bool:
        self.requestInterruption()
        return self.wait(timeout_ms)

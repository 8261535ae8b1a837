"""Runs a DecodeSession off the UI thread and hands its StepRecords to the UI thread.

One superqt GeneratorWorker per run of steps (a single step, or play until paused). The generator steps
the session and yields *batches* of records (at most every HAND_EVERY, 50 ms), so a fast model cannot flood the
event loop with one signal per token; the UI keeps only the latest for drawing. Errors travel in-band
as a WorkerFailure yielded after the records that preceded them: superqt's GeneratorWorker swallows a
RuntimeError raised by the generator (it takes it for a deleted Qt object), and CacheFullError is one.

Only one worker touches the session at a time: a new run starts only after the previous one finished.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable, NamedTuple

from PySide6.QtCore import QObject, QThreadPool, Signal
from superqt.utils import create_worker

from pagevis.engine import DecodeSession, ModelSpec, RunControl, SessionConfig, steps
from pagevis.kvcache import CacheSettings, ConfigError
from pagevis.kvcache.quant import storage_notice, storage_text
from pagevis.viewmodel.timeline import SessionInfo, Timeline, timeline_from_trace

GIL_BREATH = 0.002  # seconds the worker sleeps after a short step ...
SHORT_STEP = 0.002  # ... one that took less of the worker's CPU time than this (a model that is mostly Python)
HAND_EVERY = 0.05  # seconds: the worker hands the UI its records at most this often at max speed, until the window's
# frame pace sets `hand_every` (half a frame: each arrival costs the UI thread ~0.5 ms besides its records' own)
MAX_CAPACITY = 4096  # tokens per layer; beyond this the per-step snapshots get too heavy to keep


class WorkerFailure(NamedTuple):
    error: BaseException
    traceback: str


def run_control(budget: int | None = None, interval: float = 0.0) -> RunControl:
    """The worker's control, shared between the UI thread (writes) and the worker (reads between steps)."""
    return RunControl(budget=budget, interval=interval)


def breathe(cpu_seconds: float) -> None:
    """After a step that took less than SHORT_STEP of the worker's CPU time, leave the GIL to the UI thread
    for GIL_BREATH: a small model is mostly Python (the synthetic one runs ~1,000 steps/s) and would otherwise
    starve the event loop. A real model's step spends its time in numba and NumPy kernels, which release the
    GIL, and never pauses: SmolLM2's (~8 ms of CPU here) paused 2 ms a step when the test was the step's wall
    time (< 20 ms), a fifth of the app's decode rate. CPU time, not wall: on a busy machine a step's wall
    time grows while the thread waits for a core, and a mostly-Python step would stop pausing."""
    if cpu_seconds < SHORT_STEP:
        time.sleep(GIL_BREATH)


def worker_steps(stepper, control: RunControl, flush_every: float | Callable[[], float] = 0.02, pack=None):
    """Generator run by a worker (every window's): step `stepper` through the run loop and yield its records
    in lists, at most every `flush_every` seconds (a number, or a function read after each step; each step when
    the control paces steps, and after the last), each list passed through `pack` if given; then a WorkerFailure
    if a step raised. `control` is checked between steps; after each step the worker may `breathe`."""
    batch = []
    flushed = time.perf_counter()
    hand = pack or (lambda records: records)
    every = flush_every if callable(flush_every) else (lambda: flush_every)
    cpu = time.thread_time()
    try:
        for record in steps(stepper, control):
            stepped = time.thread_time()
            breathe(stepped - cpu)
            cpu = stepped
            batch.append(record)
            now = time.perf_counter()
            if now - flushed >= every() or control.interval > 0:
                yield hand(batch)
                batch, flushed = [], now
    except Exception as error:  # noqa: BLE001 - every failure is shown in the GUI
        if batch:
            yield hand(batch)
            batch = []
        yield WorkerFailure(error, traceback.format_exc())
    if batch:
        yield hand(batch)


class NewestRecord:
    """Stands in for DecodeSession.records in the app: the Timeline keeps every record (spilled to disk),
    so the session keeps only its newest, and len() still counts every step (the session numbers steps
    by it). Without this, a long demo held every whole record twice."""

    def __init__(self):
        self._count = 0
        self._newest = None

    def append(self, record) -> None:
        self._count += 1
        self._newest = record

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int):
        if index in (-1, self._count - 1) and self._newest is not None:
            return self._newest
        raise IndexError(f"the app's session keeps only its newest record; the timeline has record {index}")


def new_session(model, spec: ModelSpec, prompt: str, config: SessionConfig,
                session: DecodeSession | None = None) -> tuple[DecodeSession, Timeline]:
    """A DecodeSession for the app (keeping only its newest record) and the empty Timeline for its records;
    `session`: one already made (a teacher-forced A/B side's)."""
    cache = validate(config, model.config)
    session = session or DecodeSession(model, prompt, config)
    session.records = NewestRecord()
    cfg = model.config
    info = SessionInfo(spec.label, prompt, session.prompt_ids, config, cfg.n_layers, cfg.n_heads,
                       cache.total_bytes(), cfg.n_kv_heads, cache.kv_bytes_per_token(), storage_text(cache),
                       cache.sliding_windows, cache.page_bytes(), storage_notice(cache))
    return session, Timeline(info, session.token_text)


def validate(config: SessionConfig, model_config=None) -> CacheSettings:
    """The cache this configuration builds, or ConfigError. Without the model's shape, check everything
    that does not depend on it (sizes, policy parameters) and return the settings themselves."""
    capacity = config.ram_tokens
    if capacity > MAX_CAPACITY:
        raise ConfigError("max_pages", config.max_pages,
                          f"at most {MAX_CAPACITY // config.page_size} pages of {config.page_size} "
                          f"(the GUI keeps every step's snapshot; {MAX_CAPACITY} tokens per layer at most)")
    if model_config is None:
        config.check()
        return config
    return config.cache_config(model_config)


@dataclass
class SessionSlot:
    """Everything that makes one session resumable: what the runner holds, set aside."""

    spec: ModelSpec | None
    model: object
    prompt: str
    config: SessionConfig
    session: DecodeSession | None  # None for a replayed trace
    timeline: Timeline
    state: str


class SessionRunner(QObject):
    """States: idle (no model yet), loading, ready, running, done, error, replay.

    A new session never drops the one before silently: the previous session (with its timeline and its
    live DecodeSession, or a replayed trace) is kept in `previous`, and `swap_previous()` returns to it,
    still able to decode. One previous session is kept, so memory holds at most two timelines."""

    started = Signal(object)  # Timeline of a new session (or replayed trace)
    records = Signal(list)  # new StepRecords, in order
    failed = Signal(str, str)  # message, traceback
    state_changed = Signal(str)
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.spec: ModelSpec | None = None
        self.prompt = ""
        self.config = SessionConfig()
        self.model = None
        self.session: DecodeSession | None = None
        self.timeline: Timeline | None = None
        self.state = "idle"
        self.interval = 0.0
        self.hand_every = HAND_EVERY  # seconds between the worker's hand-offs at max speed (the window's pace sets it)
        self._worker = None
        self._control: RunControl | None = None
        self._loader = None
        self._pending: tuple | None = None  # a (spec, prompt, config) to start once the worker stops
        self._generation = 0  # bumps on every restart: results of older workers are dropped
        self._shut = False  # after shutdown() (its window closed) nothing starts, not even a late debounced restart
        self.previous: SessionSlot | None = None
        self.timeline_spec: ModelSpec | None = None  # the model spec of the current timeline

    # --- lifecycle -------------------------------------------------------------------------------
    def configure(self, spec: ModelSpec, prompt: str, config: SessionConfig, blocking: bool = False) -> None:
        """Start a new session (loading the model first if it changed). Stops a running worker first."""
        if self._shut:
            return
        self._generation += 1
        if self.busy:
            self._pending = (spec, prompt, config)
            self.stop()
            return
        self._pending = None
        self.prompt, self.config = prompt, config
        if self.model is not None and spec == self.spec:
            self._start_session()
            return
        self.spec, self.model = spec, None  # the current session stays until the next one replaces it
        self._set_state("loading")
        self.message.emit(f"Loading {spec.label}…")
        if blocking:
            try:
                model = self._load(spec)
            except Exception as error:  # noqa: BLE001
                self._load_failed(error)
                return
            self._loaded(model, self._generation)
            return
        generation = self._generation
        self._loader = create_worker(self._load, spec, _start_thread=False, _ignore_errors=True)
        self._loader.returned.connect(lambda model: self._loaded(model, generation))
        self._loader.errored.connect(lambda error: self._load_failed(error, generation))
        self._loader.finished.connect(self._loader_finished)
        self._loader.start()

    def _load(self, spec: ModelSpec):
        """spec.load(), saying in the window (the status bar, from the loading thread) while numba compiles the
        kernels: a first launch compiles for ~25-45 s, which the terminal alone used to say."""
        from numba.core import event

        started, runner = time.monotonic(), self

        class Progress(event.Listener):
            compiled = 0

            def on_start(self, _):
                self.compiled += 1
                runner.message.emit(f"Compiling the model's kernels, once (numba keeps them; ~25-45 s on a first "
                                    f"launch): {self.compiled} so far, {time.monotonic() - started:.0f} s")

            def on_end(self, _):
                pass

        with event.install_listener("numba:compile", Progress()):
            return spec.load()

    def _loaded(self, model, generation: int) -> None:
        if generation != self._generation:
            return
        self.model = model
        self._start_session()

    def _load_failed(self, error: BaseException, generation: int | None = None) -> None:
        if generation is not None and generation != self._generation:
            return
        expected = isinstance(error, (ValueError, OSError))  # ModelLoadError, ConfigError, a missing file
        detail = "" if expected else "".join(traceback.format_exception(error))
        named = str(error).startswith(self.spec.label)  # a load error names the file itself: once is enough
        self._fail(f"Could not load {'the model' if named else self.spec.label}: {error}", detail)

    def _loader_finished(self) -> None:
        self._loader = None
        if self._pending:
            self.configure(*self._pending)

    def _start_session(self) -> None:
        if self._same_again():
            self._restart_in_place()
            return
        try:
            session, timeline = self._new_session()
        except Exception as error:  # noqa: BLE001 - a bad prompt or configuration is shown, not raised
            self._keep_current()
            self.session = self.timeline = None
            self._fail(str(error), traceback.format_exc())
            return
        self._keep_current()
        self.session = session
        self.timeline, self.timeline_spec = timeline, self.spec
        self._set_state("ready")
        self.started.emit(self.timeline)

    def _same_again(self) -> bool:
        """A restart of the same prompt and settings in a live DecodeSession (the Reset button)."""
        info = getattr(self.timeline, "info", None)
        return (isinstance(self.session, DecodeSession) and info is not None and self.state != "replay"
                and self.timeline_spec == self.spec and info.prompt == self.prompt and info.config == self.config)

    def _restart_in_place(self) -> None:
        """Decode the prompt again in the same engine: the prompt's full pages come from its prefix cache
        (the first record's prefix_hit event says how many tokens), not from another prefill. The previous
        run's records stay as a replay (its cache state now belongs to the new run)."""
        session, info = self.session, self.timeline.info
        self.session = None
        self._keep_current()
        self.session = session
        try:
            session.restart()
        except Exception as error:  # noqa: BLE001 - shown, not raised
            self.session = self.timeline = None
            self._fail(str(error), traceback.format_exc())
            return
        session.records = NewestRecord()
        self.timeline = Timeline(info, session.token_text)
        self._set_state("ready")
        self.started.emit(self.timeline)

    def _new_session(self):
        """The session to step (anything with step() and done) and the timeline its steps extend."""
        return new_session(self.model, self.spec, self.prompt, self.config)

    def replay(self, trace) -> None:
        """Show a recorded trace: its records become the timeline; nothing decodes."""
        self._generation += 1
        self.stop()
        self._keep_current()
        self.session = None
        self.timeline = timeline_from_trace(trace)
        self.timeline_spec = getattr(trace, "model_spec", None)
        self._set_state("replay")
        self.started.emit(self.timeline)

    # --- the previous session ------------------------------------------------------------------------
    def _keep_current(self) -> None:
        """Set the current session aside as `previous` (if it recorded anything) before another replaces it."""
        if self.timeline is not None and len(self.timeline):
            state = "replay" if self.state == "replay" or self.session is None else (
                "done" if self.session.done else "ready")
            info = self.timeline.info  # the runner's spec, prompt and config may already be the next session's
            self.previous = SessionSlot(self.timeline_spec, self.session.model if self.session else self.model,
                                        info.prompt, info.config, self.session, self.timeline, state)

    def swap_previous(self) -> bool:
        """Make the previous session current again (and the current one previous). False when there is
        none, or while a worker or loader runs."""
        if self.previous is None or self.busy:
            return False
        slot = self.previous
        self.previous = None
        current_state = self.state
        self._keep_current()
        if self.state == "error" and self.previous is not None:
            self.previous.state = current_state if current_state != "error" else "ready"
        self._generation += 1
        self.spec, self.model, self.prompt, self.config = slot.spec, slot.model, slot.prompt, slot.config
        self.session, self.timeline, self.timeline_spec = slot.session, slot.timeline, slot.spec
        self._set_state(slot.state)
        self.started.emit(self.timeline)
        return True

    # --- running ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._worker is not None or self._loader is not None

    @property
    def running(self) -> bool:
        return self._worker is not None and not (self._control and self._control.stop)

    def play(self) -> None:
        self._run(None)

    def step(self, n: int = 1) -> None:
        self._run(n)

    def set_interval(self, seconds: float) -> None:
        self.interval = seconds
        if self._control is not None:
            self._control.interval = seconds

    def _run(self, budget: int | None) -> None:
        if self.session is None or self._worker is not None:
            return
        if self.session.done:
            self.message.emit(f"The session has finished ({self.session.stop_reason}); reset to decode again.")
            return
        self._control = run_control(budget, self.interval)
        generation = self._generation
        worker = create_worker(worker_steps, self.session, self._control, lambda: self.hand_every,
                               _start_thread=False, _ignore_errors=True)
        worker.yielded.connect(lambda item: self._received(item, generation))
        worker.finished.connect(self._worker_finished)
        self._worker = worker
        self._set_state("running")
        worker.start()

    def step_blocking(self, n: int) -> None:
        """Decode n steps on this thread (for screenshots and scripts); errors are reported as usual."""
        if self.session is None or self._worker is not None:
            return
        for item in worker_steps(self.session, run_control(n)):
            self._received(item, self._generation)
        self._set_state("done" if self.session.done else self.state if self.state == "error" else "ready")

    def stop(self) -> None:
        """Ask the worker to stop after its current step (pause)."""
        if self._control is not None:
            self._control.stop = True

    def _received(self, item, generation: int) -> None:
        if generation != self._generation or self.timeline is None:
            return
        if isinstance(item, WorkerFailure):
            self._fail(f"{type(item.error).__name__}: {item.error}", item.traceback)
            return
        self.timeline.extend(item)
        self.records.emit(item)

    def _worker_finished(self) -> None:
        self._worker, self._control = None, None
        if self._pending:
            self.configure(*self._pending)
            return
        if self.state == "running":
            self._set_state("done" if self.session is not None and self.session.done else "ready")

    def _fail(self, message: str, trace: str) -> None:
        self._set_state("error")
        self.failed.emit(message, trace)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)

    def shutdown(self, timeout_ms: int = 15000) -> bool:
        """Stop the worker and wait for every pool thread to finish (call before the window goes); the runner
        starts nothing after it."""
        self._shut = True
        self._generation += 1
        self._pending = None
        self.stop()
        return QThreadPool.globalInstance().waitForDone(timeout_ms)

"""GUI speed benchmark: `python -m pagevis.bench.gui.app [--steps N] [--model smollm2|synthetic]`.

Plays a model at full speed in the real window (offscreen, every view visible) and prints
  * decode speed in the GUI relative to a headless DecodeSession with the same configuration (target ≥ 0.9),
  * the UI thread's event-loop latency: how late a 5 ms QTimer fires, p50 / p99 (target p99 ≤ 50 ms),
  * the redraw rate while playing at max speed (target: at least the pace's slowest, 5 fps, or a frame per step
    when steps are slower: the window paces its frames to keep the UI thread's CPU a share of the decoder's, see
    rendering.UI_SHARE),
  * the process's CPU time a step in both runs (on a shared machine the CPU a step moves less than the wall clock),
  * where the decoding thread's wall time a step goes in both runs (Linux): its CPU, waiting for a core, blocked
    (the GIL, mostly), and the time between steps (hand-offs, pauses); and the UI thread's CPU a frame,
  * how late a 10 ms QTimer fires while the window loads the model on its worker (target p90 < 100 ms).
Both runs use one BLAS thread, as the app does. With --ab: the A/B window's lockstep speed (two sessions)
relative to the same two sessions run headless one after the other.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import os
import statistics
import sys
import time

import numpy as np

from pagevis import settings

PROMPT = ("In a paged KV cache, keys and values live in fixed-size pages. Explain, step by step and in simple "
          "words, why a streaming model keeps the first few tokens as attention sinks.")


CPU_MS: dict[str, list[float]] = {"gui": [], "headless": []}  # the process's CPU time a step, ms, per run
WORKER: dict[str, list[dict[str, float]]] = {"gui": [], "headless": []}  # StepClock.split() per run


class StepClock:
    """Where the decoding thread's wall time goes, step by step: `install(session)` wraps its `step` (on whichever
    thread calls it) to read, before and after each step, the wall clock, the thread's CPU time and (Linux) the
    time it spent runnable but waiting for a core (/proc/thread-self/schedstat). What is left of a step's wall
    time is time the thread was blocked: in the app, waiting for the GIL (the kernels release it many times a
    step; the UI thread's Python holds it); headless, nothing."""

    def __init__(self):
        self.samples: list[tuple[tuple[float, float, float], tuple[float, float, float]]] = []

    @staticmethod
    def now() -> tuple[float, float, float]:
        try:
            with open("/proc/thread-self/schedstat") as stat:
                waited = int(stat.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            waited = float("nan")
        return time.perf_counter(), time.thread_time(), waited

    def install(self, session) -> None:
        step = session.step

        def timed():
            before = self.now()
            try:
                return step()
            finally:
                self.samples.append((before, self.now()))

        session.step = timed

    def split(self) -> dict[str, float]:
        """ms a step: wall, cpu, waiting (for a core), blocked (the rest), and between (after one step, before
        the next: the app's hand-offs and pauses)."""
        if not self.samples:
            return {}
        d = np.array([[b[i] - a[i] for i in range(3)] for a, b in self.samples])
        between = [later[0][0] - earlier[1][0] for earlier, later in zip(self.samples, self.samples[1:])]
        wall, cpu, waiting = 1000 * d.mean(axis=0)
        return {"wall": wall, "cpu": cpu, "waiting": waiting, "blocked": wall - cpu - waiting,
                "between": 1000 * float(np.mean(between)) if between else 0.0}


def headless(spec, config, steps: int) -> float:
    from pagevis.engine import DecodeSession, RunControl, run

    session = DecodeSession(spec.load(), PROMPT, config)
    run(session, RunControl(budget=1))  # the prefill, timed in neither run
    worker = StepClock()
    worker.install(session)
    started, cpu = time.perf_counter(), time.process_time()
    taken = run(session, RunControl(budget=steps))
    CPU_MS["headless"].append(1000 * (time.process_time() - cpu) / taken)
    WORKER["headless"].append(worker.split())
    return taken / (time.perf_counter() - started)


def lateness_probe(interval_ms: int = 5):
    """A precise timer on the UI thread that records how late it fires, in ms: (timer, clock, lateness list).
    Start the clock, then the timer."""
    from PySide6.QtCore import QElapsedTimer, QTimer

    lateness: list[float] = []
    clock = QElapsedTimer()
    probe = QTimer(interval=interval_ms)
    probe.setTimerType(probe.timerType().PreciseTimer)

    def tick() -> None:
        lateness.append(max(clock.nsecsElapsed() / 1e6 - interval_ms, 0.0))
        clock.restart()

    probe.timeout.connect(tick)
    return probe, clock, lateness


class UiClock:
    """Where the UI thread's Python time goes while decoding: CPU seconds inside each entry point the event
    loop calls into Python (a record batch arriving, each view's update, each Python paint override). Python
    holds the GIL there, and that, not the UI's C++ painting (which runs without it), is what slows the
    worker thread's decoding. CPU time, not wall time: the wall time includes waiting for the worker's GIL."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.thread_time() - started

        setattr(owner, name, timed)

    def instrument(self, window) -> None:
        import pyqtgraph as pg

        self.wrap(window.runner.timeline, "extend", "records arrive (timeline)")
        self.wrap(window.renderer, "_update_transport", "transport, narration")
        for view in window.views:
            self.wrap(view, "show_state", f"update: {view.title}")
            for graphics in view.findChildren(pg.GraphicsView):
                self.wrap(graphics, "paintEvent", f"paint: {view.title}")


def in_gui(spec, config, steps: int, clock: UiClock | None = None) -> dict[str, float]:
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from pagevis.gui import _application
    from pagevis.gui.session.window import MainWindow

    app = _application()
    window = MainWindow(restore=False, persist=False)
    window.apply_arguments(spec, PROMPT, config)
    window.resize(1600, 1000)
    window.show()
    window.start(blocking=True)
    window.runner.step_blocking(1)  # the prefill, as in the headless run
    app.processEvents()
    if clock is not None:
        clock.instrument(window)
    worker = StepClock()
    worker.install(window.runner.session)

    probe, clock, lateness = lateness_probe()
    target = len(window.timeline) + steps
    arrived: list[float] = []
    loop = QEventLoop()  # the real event loop, as app.exec() runs it (no polling)

    def received(records) -> None:
        if len(window.timeline) >= target and not arrived:
            arrived.append(time.perf_counter())
            CPU_MS["gui"].append(1000 * (time.process_time() - process) / steps)

    def state_changed(state: str) -> None:
        if state != "running":
            loop.quit()

    window.runner.records.connect(received)
    window.runner.state_changed.connect(state_changed)
    frames = window.renderer.frames
    clock.start()
    probe.start()
    cpu, process = time.thread_time(), time.process_time()
    started = time.perf_counter()
    window.runner.step(steps)
    loop.exec()
    ui_cpu = time.thread_time() - cpu
    elapsed = arrived[0] - started
    redraws = window.renderer.frames - frames
    WORKER["gui"].append(worker.split())
    probe.stop()
    window.close()
    QApplication.processEvents()
    return {"tokens_per_s": steps / elapsed, "fps": redraws / elapsed, "ui_cpu": ui_cpu / elapsed, "p50": float(np.percentile(lateness, 50)),
            "p99": float(np.percentile(lateness, 99)), "max": float(max(lateness)), "seconds": elapsed,
            "ui_ms_frame": 1000 * ui_cpu / max(redraws, 1)}


def loading_latency(spec, config) -> dict[str, float]:
    """The UI thread's responsiveness while the window loads the model on its worker thread: how late a 10 ms
    timer fires (ms), from a cold load (the spec's shared model is dropped first)."""
    from PySide6.QtCore import QElapsedTimer, QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from pagevis.engine.model_spec import _load
    from pagevis.gui import _application
    from pagevis.gui.session.window import MainWindow

    app = _application()
    _load.cache_clear()
    window = MainWindow(restore=False, persist=False)
    window.apply_arguments(spec, PROMPT, config)
    window.resize(1600, 1000)
    window.show()
    app.processEvents()
    lateness: list[float] = []
    clock = QElapsedTimer()
    probe = QTimer(interval=10)

    def tick() -> None:
        lateness.append(max(clock.restart() - 10.0, 0.0))

    loop = QEventLoop()
    window.runner.state_changed.connect(lambda state: state != "loading" and loop.quit())
    probe.timeout.connect(tick)
    clock.start()
    probe.start()
    started = time.perf_counter()
    window.start()
    if window.runner.state == "loading":
        loop.exec()
    seconds = time.perf_counter() - started
    probe.stop()
    window.close()
    QApplication.processEvents()
    if not lateness:
        lateness.append(0.0)
    return {"seconds": seconds, "ticks": len(lateness), "p90": float(np.percentile(lateness, 90)),
            "max": float(max(lateness))}


def ab_in_gui(spec, config_a, config_b, steps: int) -> float:
    """Lockstep steps per second of the A/B window (its worker thread, the real event loop), prefill excluded."""
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from pagevis.gui import _application
    from pagevis.gui.ab.window import ABWindow

    app = _application()
    window = ABWindow(spec, PROMPT, config_a, config_b)
    window.show()
    window.start(blocking=True)
    window.runner.step_blocking(1)
    app.processEvents()
    loop = QEventLoop()
    window.runner.state_changed.connect(lambda state: loop.quit() if state != "running" else None)
    started = time.perf_counter()
    window.runner.step(steps)
    loop.exec()
    elapsed = time.perf_counter() - started
    done = len(window.timeline) - 1
    window.close()
    QApplication.processEvents()
    return done / elapsed


def ab_main(spec, config, steps: int, repeat: int) -> None:
    """A/B (sinks vs oldest, same cache) in lockstep against the same two sessions run headless one after
    the other: one core can do no better than that, so the ratio is the A/B window's overhead."""
    config_b = replace(config, policy="oldest" if config.policy != "oldest" else "sinks", policy_params={})
    ab, both = [], []
    for _ in range(repeat):
        ab.append(ab_in_gui(spec, config, config_b, steps))
        a, b = headless(spec, config, steps), headless(spec, config_b, steps)
        both.append(1 / (1 / a + 1 / b))
    speed, base = statistics.median(ab), statistics.median(both)
    print(f"A/B ({config.policy} vs {config_b.policy}): {speed:.2f} lockstep steps/s; two headless runs back to "
          f"back: {base:.2f} steps/s; ratio {speed / base:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.gui.app",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run (default 64)")
    parser.add_argument("--model", choices=("smollm2", "synthetic"), default="smollm2")
    settings.add_flags(parser, names=("page_size", "max_pages", "policy"), page_size=8, max_pages=8, policy="sinks")
    parser.add_argument("--repeat", type=int, default=1, help="alternate GUI and headless runs this many times")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print where the UI thread's Python time goes, in ms per decoded token")
    parser.add_argument("--ab", action="store_true",
                        help="measure the A/B window's lockstep speed against two headless runs instead")
    parser.add_argument("--app-defaults", action="store_true",
                        help="play what `pagevis` opens with: the Default preset's settings and prompt (instead of "
                             "this bench's prompt and the cache flags)")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from pagevis.engine import ModelSpec, SessionConfig
    from pagevis.gui.session import rendering
    from pagevis.model import set_blas_threads

    spec = ModelSpec(kind=args.model)
    config = settings.apply(SessionConfig(max_new_tokens=args.steps + 8), vars(args))
    if args.app_defaults:
        global PROMPT
        from pagevis import presets

        PROMPT = presets.default_prompt(args.model)
        config = replace(presets.DEFAULT_CONFIG, max_new_tokens=max(presets.DEFAULT_CONFIG.max_new_tokens, args.steps + 8))
    print(f"model {spec.label}; {args.steps} decode steps; cache {config.max_pages} pages x {config.page_size}, "
          f"policy {config.policy}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    set_blas_threads(1)
    spec.load()
    if args.ab:
        ab_main(spec, config, args.steps, args.repeat)
        return 0
    loading = loading_latency(spec, config)
    print(f"while loading the model ({loading['seconds']:.1f} s, {loading['ticks']} ticks of a 10 ms timer): "
          f"late by p90 {loading['p90']:.0f} ms, max {loading['max']:.0f} ms (target p90 < 100 ms: "
          f"{'ok' if loading['p90'] < 100 else 'MISSED'})")
    gui_runs, headless_runs = [], []
    for _ in range(args.repeat):
        gui_runs.append(in_gui(spec, config, args.steps))
        headless_runs.append(headless(spec, config, args.steps))
    gui_speed = statistics.median(r["tokens_per_s"] for r in gui_runs)
    base = statistics.median(headless_runs)
    last = gui_runs[-1]
    fps = statistics.median(r["fps"] for r in gui_runs)
    p50 = statistics.median(r["p50"] for r in gui_runs)
    p99 = statistics.median(r["p99"] for r in gui_runs)

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    print(f"decode speed: GUI {gui_speed:.2f} tok/s, headless {base:.2f} tok/s, ratio {gui_speed / base:.2f} "
          f"(target >= 0.9: {verdict(gui_speed / base >= 0.9)})")
    print(f"event-loop latency: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {last['max']:.1f} ms "
          f"(target p99 <= 50 ms: {verdict(p99 <= 50)})")
    ui = statistics.median(r["ui_cpu"] for r in gui_runs)
    print(f"UI thread CPU: {ui:.0%} of one core while playing")
    gui_cpu, headless_cpu = statistics.median(CPU_MS["gui"]), statistics.median(CPU_MS["headless"])
    print(f"CPU time a step (the process, every thread): GUI {gui_cpu:.1f} ms, headless {headless_cpu:.1f} ms; "
          f"their ratio {headless_cpu / gui_cpu:.2f} is the app's rate over headless on a machine whose cores are all "
          f"busy (the UI thread's CPU then comes out of the decoder's share; steadier than the wall clock's ratio)")
    print_worker(statistics.median(r["ui_ms_frame"] for r in gui_runs))
    slowest = 1 / rendering.MAX_FRAME_INTERVAL  # the pace never draws fewer frames while records arrive
    print(f"redraw rate: {fps:.1f} fps while playing, {fps / gui_speed:.2f} frames per token (target >= "
          f"{slowest:.0f} fps, the pace's slowest, or one frame per step when steps are slower: "
          f"{verdict(fps >= 0.9 * min(slowest, gui_speed))})")
    if args.breakdown:
        print_breakdown(spec, config, args.steps)
    return 0


def print_worker(ui_ms_frame: float) -> None:
    """The decoding thread's ms a step, GUI / headless (medians over the runs), and the UI thread's CPU a frame."""
    def part(name: str) -> str:
        gui, alone = (statistics.median(split[name] for split in WORKER[run] if split) for run in ("gui", "headless"))
        return f"{gui:.2f} / {alone:.2f}"

    if not all(WORKER[run] and WORKER[run][0] for run in WORKER):
        return
    print(f"decoding thread, ms a step (GUI / headless): wall {part('wall')} = CPU {part('cpu')} + waiting for a core "
          f"{part('waiting')} + blocked (the GIL, mostly) {part('blocked')}; between steps {part('between')}")
    print(f"UI thread: {ui_ms_frame:.1f} ms of CPU a frame (records arriving included); on a busy machine it comes "
          f"out of the same share of the cores as the decoder's")


def print_breakdown(spec, config, steps: int) -> None:
    clock = UiClock()
    run = in_gui(spec, config, steps, clock)
    tokens = run["tokens_per_s"] * run["seconds"]
    per_token = 1000 / run["tokens_per_s"]
    print(f"\nUI thread, ms per token (a token every {per_token:.1f} ms; CPU time, Python holds the GIL in each):")
    for label, seconds in sorted(clock.seconds.items(), key=lambda item: -item[1]):
        print(f"  {label:<34} {1000 * seconds / tokens:6.2f}")
    total = sum(clock.seconds.values())
    print(f"  {'all of the above':<34} {1000 * total / tokens:6.2f}  ({total / run['seconds']:.0%} of the wall clock; "
          f"UI thread CPU with C++ painting: {run['ui_cpu']:.0%})")


if __name__ == "__main__":
    sys.exit(main())

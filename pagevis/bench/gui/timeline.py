"""Timeline memory and latency benchmark: `python -m pagevis.bench.gui.timeline [--checkpoints 1000,10000,50000]`.

Decodes a long session in the real window (offscreen, every view visible, the app's default cache) and at
each checkpoint prints
  * the process's resident memory (RSS) and the timeline's own bytes per step (target: < 1.5 GB at 50 000
    steps; <= 25 KB per step at the SmolLM2 defaults),
  * scrub latency: selecting a random earlier step and redrawing every view, p50 / max wall-clock and the UI
    thread's median CPU time (target < 50 ms),
  * layer-switch latency: another layer, every view redrawn, the same (target < 50 ms).
The synthetic model (default) decodes ~400 steps/s, so 50 000 steps take minutes; `--model smollm2` measures
the per-step memory at SmolLM2's 30 layers over a shorter run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def timed(action) -> tuple[float, float]:
    """Wall-clock and UI-thread CPU milliseconds of `action` (CPU time is what a busy machine inflates least)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    action()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def measure(window, app, rng: random.Random, repeats: int) -> dict[str, float]:
    count = len(window.timeline)
    scrubs = [timed(lambda: (window.scrub(rng.randrange(count)), app.processEvents())) for _ in range(repeats)]
    layers = window.timeline.info.n_layers
    switches = []
    for _ in range(repeats):
        layer = (window.controls.layer.value() + 1 + rng.randrange(max(layers - 1, 1))) % layers
        switches.append(timed(lambda: (window.controls.layer.setValue(layer), window.redraw(), app.processEvents())))
    window.scrub(count - 1)
    out = {}
    for name, runs in (("scrub", scrubs), ("layer", switches)):
        out[f"{name}_p50"] = statistics.median(w for w, _ in runs)
        out[f"{name}_max"] = max(w for w, _ in runs)
        out[f"{name}_cpu"] = statistics.median(c for _, c in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.gui.timeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", default="1000,10000,50000", help="steps at which to measure")
    parser.add_argument("--model", choices=("synthetic", "smollm2"), default="synthetic")
    parser.add_argument("--repeats", type=int, default=15, help="scrubs and layer switches per checkpoint")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))

    from pagevis.engine import ModelSpec
    from pagevis.model import set_blas_threads
    from pagevis.presets import DEFAULT_CONFIG, default_prompt
    from pagevis.gui import _application
    from pagevis.gui.session.window import MainWindow

    set_blas_threads(1)
    spec = ModelSpec(kind=args.model)
    config = replace(DEFAULT_CONFIG, max_new_tokens=checkpoints[-1] + 8)
    app = _application()
    window = MainWindow(restore=False, persist=False)
    window.apply_arguments(spec, default_prompt(spec.kind), config)
    window.resize(1600, 1000)
    window.show()
    window.start(blocking=True)
    app.processEvents()
    baseline = rss_bytes()
    print(f"model {spec.label}; cache {config.max_pages} pages x {config.page_size}, policy {config.policy}; "
          f"RSS after loading {baseline / 2**20:.0f} MiB; load average {os.getloadavg()[0]:.1f}")
    print(f"{'steps':>7} {'RSS MiB':>8} {'RSS/step':>9} {'timeline/step':>14} {'spill MiB':>10} "
          f"{'scrub p50/max/cpu ms':>22} {'layer p50/max/cpu ms':>22} {'steps/s':>8}")
    rng = random.Random(0)
    started, done = time.perf_counter(), 0
    for checkpoint in checkpoints:
        while len(window.timeline) < checkpoint:
            window.runner.step_blocking(min(500, checkpoint - len(window.timeline)))
            window.redraw()
            app.processEvents()
        done = len(window.timeline)
        speed = done / (time.perf_counter() - started)
        timeline = window.timeline
        rss = rss_bytes()
        m = measure(window, app, rng, args.repeats)
        print(f"{done:>7} {rss / 2**20:>8.0f} {(rss - baseline) / done / 1024:>7.1f}KB "
              f"{timeline.memory_bytes() / done / 1024:>12.2f}KB {timeline.spill.disk_bytes / 2**20:>10.0f} "
              f"{m['scrub_p50']:>8.1f}/{m['scrub_max']:.1f}/{m['scrub_cpu']:<5.1f} "
              f"{m['layer_p50']:>8.1f}/{m['layer_max']:.1f}/{m['layer_cpu']:<5.1f} "
              f"{speed:>8.0f}", flush=True)
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

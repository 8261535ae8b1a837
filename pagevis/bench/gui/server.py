"""Server window benchmark: `python -m pagevis.bench.gui.server [--model smollm2|synthetic] [--seconds S] [--ab]`.

* latency: the Server window (offscreen, every view visible, 1600 × 1000) serving its default preset — the
  shared-system-prompt chat, prefix caching on vs off — at 30 requests per minute (--rate) in its worker thread,
  in real time, for S seconds. Prints how late a 5 ms QTimer fires on the UI thread (p50 / p99 / max; target p99 ≤
  50 ms), the redraw rate, and the steps taken.
* --ab: the same A/B (the window's ServerPair, headless) served to the end at 30 requests per minute, at the
  preset's 90, and with every request arriving at once (the server saturated); prints each side's throughput (generated tokens / server
  seconds until the last request is done), TTFT and prefill tokens, and A/B (target ≥ 1.5×).
Both use one BLAS thread, as the app does; the load average is printed with each (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import numpy as np


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _preset(rate: float | None):
    """The default server preset (the shared-system-prompt chat, prefix caching on vs off), at `rate`."""
    from pagevis.presets import SERVER_PRESETS

    preset = SERVER_PRESETS[0]
    return preset if rate is None else replace(preset, workload=replace(preset.workload, rate_per_min=rate))


def latency(spec, seconds: float, rate: float | None = 30.0) -> dict[str, float]:
    from PySide6.QtCore import QEventLoop, QTimer

    from pagevis.gui import _application
    from pagevis.bench.gui.app import lateness_probe
    from pagevis.gui.server.window import ServerWindow

    app = _application()
    window = ServerWindow(spec.load(), _preset(rate), model_label=spec.label, realtime=True)
    window.resize(1600, 1000)
    window.show()
    app.processEvents()
    probe, clock, lateness = lateness_probe()
    loop = QEventLoop()
    QTimer.singleShot(int(seconds * 1000), loop.quit)
    frames = window.frames
    clock.start()
    probe.start()
    started = time.perf_counter()
    window.run_button.setChecked(True)
    loop.exec()
    elapsed = time.perf_counter() - started
    probe.stop()
    window.run_button.setChecked(False)
    window.shutdown()
    app.processEvents()
    steps = {side: len(series) for side, series in window.series.items()}
    summary = {side: series.summary() for side, series in window.series.items()}
    window.close()
    return {"p50": float(np.percentile(lateness, 50)), "p99": float(np.percentile(lateness, 99)),
            "max": float(max(lateness)), "fps": (window.frames - frames) / elapsed, "seconds": elapsed,
            "steps": steps, "summary": summary}


def ab(spec, rate: float | None) -> dict:
    from pagevis.engine import RunControl, run
    from pagevis.simserver.run import ServerPair, ServerRun, side_configs
    from pagevis.simserver.workload import ArrivalSchedule

    preset = _preset(rate)
    model = spec.load()
    schedule = ArrivalSchedule(preset.workload, model)
    a, b = (ServerRun(model, preset.session_config(), config, schedule, side)
            for side, config in zip("AB", side_configs(preset.server, preset.compare)))
    prefill = {"A": 0, "B": 0}
    ttft = {"A": [], "B": []}

    def on_step(step) -> None:
        prefill[step.side] += step.prefill_tokens
        ttft[step.side].extend(step.ttft)

    started = time.perf_counter()
    run(ServerPair(a, b), RunControl(), on_step)
    wall = time.perf_counter() - started
    out = {"rate": preset.workload.rate_per_min, "wall": wall, "load": _load()}
    for side in (a, b):
        step = side.last_step
        out[side.side] = {"label": side.config.label, "server_s": side.clock, "generated": step.generated,
                          "completed": step.completed, "throughput": step.generated / side.clock,
                          "ttft_mean": float(np.mean(ttft[side.side])), "prefill_tokens": prefill[side.side],
                          "preemptions": step.preemptions, "hit_rate": step.prefix_hits / max(step.prefix_queries, 1)}
        side.close()
    out["gain"] = out["A"]["throughput"] / out["B"]["throughput"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.gui.server",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "synthetic"))
    parser.add_argument("--seconds", type=float, default=90.0, help="latency run length (wall seconds)")
    parser.add_argument("--ab", action="store_true", help="also serve the A/B to the end (minutes on SmolLM2)")
    parser.add_argument("--rate", type=float, default=30.0, help="arrivals per minute of the latency run (the "
                        "target's 30; the preset's own is 90)")
    parser.add_argument("--no-latency", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from pagevis.engine import ModelSpec
    from pagevis.model import set_blas_threads

    set_blas_threads(1)
    spec = ModelSpec(kind=args.model)
    if not args.no_latency:
        before = _load()
        result = latency(spec, args.seconds, args.rate)
        print(f"latency ({spec.label}, default server preset at {args.rate:g}/min, {result['seconds']:.0f} s; "
              f"{before} → {_load()})")
        print(f"  UI timer lateness p50 {result['p50']:.1f} ms, p99 {result['p99']:.1f} ms, max {result['max']:.1f} ms"
              f" (target p99 <= 50); {result['fps']:.1f} redraws/s; steps {result['steps']}")
        for side, numbers in result["summary"].items():
            if numbers:
                print(f"  {side}: {numbers['completed']:.0f} done, {numbers['generated']:.0f} tokens in "
                      f"{numbers['time']:.1f} server s = {numbers['throughput']:.2f} tok/s")
    if args.ab:
        for rate in (30.0, None, 6000.0):
            r = ab(spec, rate)
            print(f"A/B at {r['rate']:g} requests/min ({r['wall']:.0f} s wall; {r['load']})")
            for side in "AB":
                s = r[side]
                print(f"  {side} {s['label']}: {s['completed']} done, {s['generated']} tokens in {s['server_s']:.1f} "
                      f"server s = {s['throughput']:.2f} tok/s; mean TTFT {s['ttft_mean']:.2f} s; "
                      f"{s['prefill_tokens']} prefill tokens; hit rate {s['hit_rate']:.0%}; "
                      f"{s['preemptions']} preemptions")
            print(f"  throughput A/B: {r['gain']:.2f}x (target >= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

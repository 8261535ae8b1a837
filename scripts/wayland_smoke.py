"""Wayland smoke test: the app with Qt's wayland plugin on a headless weston, on SmolLM2.

Run with WAYLAND_DISPLAY pointing at a weston started with `--debug` (so that weston-screenshooter may
take the compositor's picture); scripts/wayland_smoke.sh sets that up:
    python scripts/wayland_smoke.py OUTDIR

1. `pagevis --screenshot steps.png --steps 10` with QT_QPA_PLATFORM=wayland exits 0 with a window picture
   (Wayland lets no client read the screen, so this one is Qt's rendering of the window).
2. Meanwhile `weston-screenshooter` takes the compositor's picture every half second: the last one taken
   while the app was up must differ from the empty desktop over an area at least as large as the window,
   i.e. weston composited the window. Its picture is left in OUTDIR as compositor.png.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from xvfb_smoke import STEP_TIMEOUT, check_window_picture, read_png, report, save_png


def screenshot(workdir: Path, env: dict) -> Path | None:
    """weston-screenshooter writes wayland-screenshot-<time>.png in its working directory."""
    before = set(workdir.glob("wayland-screenshot-*.png"))
    subprocess.run(["weston-screenshooter"], cwd=workdir, env=env, timeout=20, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    new = sorted(set(workdir.glob("wayland-screenshot-*.png")) - before)
    return new[-1] if new else None


def main(argv: list[str]) -> int:
    outdir = Path(argv[1] if len(argv) > 1 else "wayland-smoke").resolve()
    shots = outdir / "compositor"
    shots.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, QT_QPA_PLATFORM="wayland")
    problems: list[str] = []

    empty = screenshot(shots, env)
    if empty is None:
        print("FAIL weston-screenshooter took no picture (is weston running with --debug and a renderer?)")
        return 1
    desktop = read_png(empty)
    command = [sys.executable, "-m", "pagevis", "--screenshot", str(outdir / "steps.png"), "--steps", "10"]
    print("  $ QT_QPA_PLATFORM=wayland " + " ".join(command[1:]))
    app = subprocess.Popen(command, env=env)
    taken: list[Path] = []
    deadline = time.monotonic() + STEP_TIMEOUT
    while app.poll() is None and time.monotonic() < deadline:
        picture = screenshot(shots, env)
        if picture is not None and app.poll() is None:
            taken.append(picture)
        time.sleep(0.5)
    if app.poll() is None:
        app.kill()
        app.wait()
        problems.append(f"the app did not finish within {STEP_TIMEOUT} s")
    elif app.returncode != 0:
        problems.append(f"pagevis exited with {app.returncode}")

    if (outdir / "steps.png").is_file():
        window = read_png(outdir / "steps.png")
        problems += check_window_picture(window, "steps.png", desktop.shape[1::-1])
        changed = [(p, int((np.abs(read_png(p).astype(np.int16) - desktop).max(axis=2) > 16).sum())) for p in taken]
        best = max(changed, key=lambda item: item[1], default=(None, 0))
        area = window.shape[0] * window.shape[1]
        print(f"  weston-screenshooter: {len(taken)} pictures while the app ran; the most changed differs from "
              f"the empty desktop in {best[1]} pixels (the window has {area})")
        if best[0] is None or best[1] < 0.8 * area:
            problems.append("no compositor picture shows the window")
        else:
            save_png(read_png(best[0]), outdir / "compositor.png")
    else:
        problems.append("steps.png: not written")
    for picture in shots.glob("wayland-screenshot-*.png"):
        picture.unlink()

    return report("wayland smoke", problems)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

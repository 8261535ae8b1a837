"""Real-display smoke test: the app on a real X server (Xvfb), on SmolLM2, through its own entry point.

Run under an X server with xwd available (scripts/xvfb_smoke.sh sets that up):
    python scripts/xvfb_smoke.py OUTDIR [SCREEN, e.g. 1600x1000]

1. `python -m pagevis.platform_check` says Qt's platform plugin can load (QT_QPA_PLATFORM=xcb).
2. `pagevis --screenshot first.png --steps 0` and `--screenshot steps.png --steps 10` on the xcb platform:
   the window opens on the X server and the app reads its pixels back from the server.
3. While the second one runs, `xwd -root` captures the whole X screen every half second, independently of
   Qt: the screen's root is black (Xvfb -br), so the box of non-black pixels is the window. It must be
   where and as large as the screenshot says, and its content must not be blank.
4. A presenter's rehearsal, with its own XDG_CONFIG_HOME (OUTDIR/config, emptied first): `pagevis --preset
   streaming` plays its A/B for a few seconds, `pagevis --preset default --policy oldest --max-pages 8` shows its
   banner, each then closed as a user closes it (settings saved); then `pagevis` with no flags must open the
   first launch's default settings (policy and cache), no banner, and say so in its status bar. What each launch
   showed comes from the app itself (its startup probe's JSON: pagevis/gui/startup.py).
The PNGs and the last root capture (root.png) are left in OUTDIR. Exit status 0 when all checks pass.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

STEP_TIMEOUT = 150  # seconds for one app run: SmolLM2 loads in ~3-10 s, 10 steps take ~1-3 s


def read_xwd(data: bytes) -> np.ndarray:
    """An XWD screen dump (ZPixmap of 24 or 32 bits per pixel, as `xwd -root` writes on a 24-bit screen) as
    (height, width, 3) uint8 RGB."""
    fields = struct.unpack(">25I", data[:100])  # the header is big-endian whatever the machine
    header_size, _, pixmap_format, depth, width, height = fields[:6]
    byte_order, bits_per_pixel, bytes_per_line = fields[7], fields[11], fields[12]
    red_mask, green_mask, blue_mask = fields[14:17]
    ncolors = fields[19]
    if pixmap_format != 2 or bits_per_pixel not in (24, 32) or depth < 24:
        raise ValueError(f"unsupported XWD: format {pixmap_format}, depth {depth}, {bits_per_pixel} bits per pixel")
    start = header_size + 12 * ncolors
    size = bits_per_pixel // 8
    raw = np.frombuffer(data, dtype=np.uint8, count=height * bytes_per_line, offset=start)
    raw = raw.reshape(height, bytes_per_line)[:, : width * size].reshape(height, width, size).astype(np.uint32)
    order = range(size) if byte_order == 0 else range(size - 1, -1, -1)  # 0: least significant byte first
    rows = sum(raw[..., i] << (8 * k) for k, i in enumerate(order))

    def channel(mask: int) -> np.ndarray:
        shift = (mask & -mask).bit_length() - 1
        return ((rows & mask) >> shift).astype(np.uint8)

    return np.dstack([channel(red_mask), channel(green_mask), channel(blue_mask)])


def read_png(path: Path) -> np.ndarray:
    """A PNG as (height, width, 3) uint8, through Qt's image reader (no application needed)."""
    from PySide6.QtGui import QImage

    image = QImage(str(path))
    if image.isNull():
        raise ValueError(f"{path}: not a readable image")
    image = image.convertToFormat(QImage.Format_RGB888)
    width, height, stride = image.width(), image.height(), image.bytesPerLine()
    buffer = np.frombuffer(image.constBits(), dtype=np.uint8, count=stride * height).reshape(height, stride)
    return buffer[:, : width * 3].reshape(height, width, 3).copy()


def save_png(pixels: np.ndarray, path: Path) -> None:
    from PySide6.QtGui import QImage

    height, width, _ = pixels.shape
    data = np.ascontiguousarray(pixels)
    QImage(data.data, width, height, 3 * width, QImage.Format_RGB888).save(str(path))


def check_window_picture(pixels: np.ndarray, name: str, screen: tuple[int, int]) -> list[str]:
    """Problems with a picture that should be the whole window: its size and that it is not blank."""
    problems = []
    height, width, _ = pixels.shape
    if not (0.5 * screen[0] <= width <= screen[0] and 0.5 * screen[1] <= height <= screen[1]):
        problems.append(f"{name}: {width} x {height} is not a window on a {screen[0]} x {screen[1]} screen")
    colours = len(np.unique(pixels.reshape(-1, 3)[:: 7], axis=0))
    spread = float(pixels.std())
    if spread < 10 or colours < 64:
        problems.append(f"{name}: blank (pixel std {spread:.1f}, {colours} colours)")
    print(f"  {name}: {width} x {height}, pixel std {spread:.1f}, {colours} colours")
    return problems


def run_app(outdir: Path, name: str, steps: int, env: dict, capture_root: bool) -> tuple[int, list[Path]]:
    """One `pagevis --screenshot` run on the xcb platform; with capture_root, `xwd -root` every 0.5 s meanwhile."""
    command = [sys.executable, "-m", "pagevis", "--screenshot", str(outdir / name), "--steps", str(steps)]
    print("  $ QT_QPA_PLATFORM=xcb " + " ".join(command[1:]))
    app = subprocess.Popen(command, env=env)
    captures: list[Path] = []
    deadline = time.monotonic() + STEP_TIMEOUT
    while app.poll() is None and time.monotonic() < deadline:
        if capture_root:
            target = outdir / f"root-{len(captures):03d}.xwd"
            taken = subprocess.run(["xwd", "-root", "-silent", "-out", str(target)], timeout=20, check=False, env=env)
            # only whole captures taken while the app was up (xwd fails, leaving a cut file, if a window
            # vanishes under it as the app closes)
            if taken.returncode == 0 and target.is_file() and app.poll() is None:
                captures.append(target)
        time.sleep(0.5)
    if app.poll() is None:
        app.kill()
        app.wait()
        print(f"  {name}: the app did not finish within {STEP_TIMEOUT} s")
        return 124, captures
    return app.returncode, captures


def window_box(root: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x, y, width, height) of the non-black pixels of a root capture, or None if it is all black."""
    lit = root.max(axis=2) > 0
    if not lit.any():
        return None
    ys, xs = np.nonzero(lit)
    return int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)


def main(argv: list[str]) -> int:
    outdir = Path(argv[1] if len(argv) > 1 else "xvfb-smoke")
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, QT_QPA_PLATFORM="xcb")
    problems: list[str] = []

    verdict = subprocess.run([sys.executable, "-m", "pagevis.platform_check"], env=env, check=False)
    if verdict.returncode != 0:
        return 1
    screen = tuple(int(v) for v in (argv[2] if len(argv) > 2 else "1600x1000").split("x"))

    status, _ = run_app(outdir, "first.png", 0, env, capture_root=False)
    if status != 0:
        problems.append(f"first.png: pagevis exited with {status}")
    status, captures = run_app(outdir, "steps.png", 10, env, capture_root=True)
    if status != 0:
        problems.append(f"steps.png: pagevis exited with {status}")

    shots = {}
    for name in ("first.png", "steps.png"):
        if (outdir / name).is_file():
            shots[name] = read_png(outdir / name)
            problems += check_window_picture(shots[name], name, screen)
        else:
            problems.append(f"{name}: not written")

    # independent of Qt: the X server's own picture of the screen while the app was up
    boxes = []
    for capture in captures:
        try:
            root = read_xwd(capture.read_bytes())
        except (ValueError, struct.error) as error:
            print(f"  {capture.name}: unreadable ({error}); not counted")
            continue
        boxes.append((capture, root, window_box(root)))
    seen = [(c, r, b) for c, r, b in boxes if b is not None]
    print(f"  xwd -root: {len(captures)} captures while the app ran, {len(seen)} show a window")
    if not seen:
        problems.append("no xwd capture of the X screen showed the window")
    elif "steps.png" in shots:
        capture, root, (x, y, w, h) = seen[-1]
        save_png(root, outdir / "root.png")
        sh, sw = shots["steps.png"].shape[:2]
        print(f"  window on the X screen: {w} x {h} at ({x}, {y}); the app's screenshot: {sw} x {sh}")
        if abs(w - sw) > 4 or abs(h - sh) > 4:
            problems.append(f"the X screen shows a {w} x {h} window, the screenshot is {sw} x {sh}")
        problems += check_window_picture(root[y:y + h, x:x + w], f"{capture.name} (window area)", screen)
        if w == sw and h == sh:
            difference = float(np.abs(root[y:y + h, x:x + w].astype(np.int16) - shots["steps.png"]).mean())
            print(f"  mean difference between the last X capture and steps.png: {difference:.2f} / 255")
    for capture in captures:
        capture.unlink()

    problems += rehearse(outdir, env)
    return report("xvfb smoke", problems)


def launch_probed(outdir: Path, name: str, flags: list[str], env: dict, linger_s: float) -> dict:
    """`pagevis FLAGS` until its session is ready and drawn (plus linger_s), closed as a user closes it; what its
    window showed (the startup probe's JSON), {} if it wrote none."""
    probe = outdir / f"{name}.json"
    probe.unlink(missing_ok=True)
    env = dict(env, PAGEVIS_STARTUP_PROBE=str(probe), PAGEVIS_STARTUP_T0=str(time.time()),
               PAGEVIS_STARTUP_PROBE_LINGER=str(linger_s))
    print("  $ pagevis " + " ".join(flags))
    try:
        run = subprocess.run([sys.executable, "-m", "pagevis", *flags], env=env, timeout=STEP_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        print(f"  {name}: not closed within {STEP_TIMEOUT} s")
        return {}
    shown = json.loads(probe.read_text()) if probe.is_file() else {}
    print(f"  {name}: exit {run.returncode}, ready after {shown.get('phases', {}).get('ready', -1):.1f} s, "
          f"showed {brief(shown.get('window'))}" + (f"; closing: {brief(shown['closing'])}" if "closing" in shown else ""))
    return shown if run.returncode == 0 else {}


def brief(shown: dict | None) -> str:
    if not shown:
        return "nothing"
    banner = shown.get("banner", "")
    return ", ".join(f"{k} {v!r}" for k, v in shown.items() if k != "banner") + \
        f", banner {(banner[:60] + '…') if len(banner) > 60 else banner!r}"


def rehearse(outdir: Path, env: dict) -> list[str]:
    """Step 4 of the module docstring: a preset's session is never what a plain relaunch opens."""
    config = (outdir / "config").resolve()  # Qt ignores a relative XDG_CONFIG_HOME (the XDG spec's rule) and reads ~/.config
    shutil.rmtree(config, ignore_errors=True)
    config.mkdir(parents=True)
    env = dict(env, XDG_CONFIG_HOME=str(config))
    print("  rehearsal: presets, quit, relaunch (XDG_CONFIG_HOME=" + str(config) + ")")
    ab = launch_probed(outdir, "rehearsal-ab", ["--preset", "streaming"], env, linger_s=5)
    main = launch_probed(outdir, "rehearsal-main", ["--preset", "default", "--policy", "oldest", "--max-pages", "8"],
                         env, linger_s=1)
    plain = launch_probed(outdir, "rehearsal-relaunch", [], env, linger_s=0)
    if not (ab and main and plain):
        return ["rehearsal: a launch failed or wrote no probe (see above)"]
    problems = []
    first, closing = ab["window"], ab.get("closing", {})
    if not first["status"].startswith("The default settings") or first["banner"]:
        problems.append(f"rehearsal: the first launch on an empty config did not open the defaults: {first}")
    if not (closing.get("ab_window") and closing.get("ab_steps", 0) > 0):
        problems.append(f"rehearsal: --preset streaming's A/B window did not play: {closing}")
    if not main["window"]["banner"] or main["window"]["policy"] != "oldest":
        problems.append(f"rehearsal: --preset default --policy oldest showed no banner or not its policy: {main}")
    cache = ("policy", "page_size", "max_pages")
    relaunch = plain["window"]
    if [relaunch[k] for k in cache] != [first[k] for k in cache]:
        problems.append(f"rehearsal: the relaunch opened {[relaunch[k] for k in cache]}, not the defaults "
                        f"{[first[k] for k in cache]}")
    if relaunch["banner"]:
        problems.append(f"rehearsal: the relaunch shows a preset's banner: {relaunch['banner']!r}")
    if not relaunch["status"].startswith(("The default settings", "Restored your last settings")):
        problems.append(f"rehearsal: the relaunch's status bar says {relaunch['status']!r}")
    return problems


def report(name: str, problems: list[str]) -> int:
    """Print each problem and the verdict; the exit status."""
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"{name}: " + ("passed" if not problems else "FAILED"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

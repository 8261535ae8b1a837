"""Startup time: `pagevis` to its first drawn frame, cold and warm (`pagevis bench startup`).

Each run spawns `python -m pagevis` (offscreen unless QT_QPA_PLATFORM is set; its own empty settings folder,
so a first start) with the startup probe (pagevis.gui.startup), which quits the app once the ready session is
drawn and says when each phase ended. Cold: the model file and the packages it starts from (pagevis, PySide6,
shiboken6, pyqtgraph, numpy, superqt) are first dropped from the page cache with posix_fadvise(DONTNEED) — only
those files, unlike drop_caches — so their pages come from the disk again; warm: the runs right after.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagevis.gui.startup import ENV_FILE, ENV_T0, PHASES

PACKAGES = ("pagevis", "PySide6", "shiboken6", "pyqtgraph", "numpy", "superqt", "gguf")
TIMEOUT = 300  # seconds for one start; SmolLM2 takes a few on an idle machine
TARGET_WARM = 3.0  # seconds to the first drawn frame, warm, SmolLM2 (issue #30)


def package_files(names=PACKAGES) -> list[Path]:
    """Every file of the installed packages `names` (those installed)."""
    files = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            files += [p for p in Path(folder).rglob("*") if p.is_file()]
    return files


def evict_from_page_cache(paths) -> int:
    """Ask the kernel to drop these files' cached pages (a file mapped or written meanwhile keeps them):
    the bytes asked for."""
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def cached_bytes(paths) -> int:
    """How many bytes of these files the page cache holds now (mincore over a read-only mapping): a file another
    process has mapped keeps its pages whatever posix_fadvise asks, so a cold start here is only as cold as this
    says."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    total = 0
    for path in paths:
        try:
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if size == 0:
                continue
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                continue
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) == 0:
                total += sum(b & 1 for b in vector) * mmap.PAGESIZE
            libc.munmap(address, size)
        finally:
            os.close(fd)
    return total


def start_once(argv: list[str], settings_dir: str) -> dict:
    """One start of `python -m pagevis ARGV`: {"phases": {phase: s since spawn}, "cpu": {phase: CPU s}}."""
    with tempfile.TemporaryDirectory(prefix="pagevis-startup-") as folder:
        out = os.path.join(folder, "probe.json")
        env = {**os.environ, ENV_FILE: out, "XDG_CONFIG_HOME": settings_dir}
        env.setdefault("QT_QPA_PLATFORM", "offscreen")
        env[ENV_T0] = repr(time.time())
        done = subprocess.run([sys.executable, "-m", "pagevis", *argv], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pagevis {' '.join(argv)} did not start (exit {done.returncode}): {tail}")
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def run_startup_bench(model: str = "smollm2", warm_runs: int = 2, cold: bool = True) -> list[dict]:
    """Rows: one cold start (if asked) and `warm_runs` warm ones, each its phases' end times and CPU seconds."""
    from pagevis.model.locate import default_model_path

    argv = ["--model", model]
    model_file = str(default_model_path()) if model == "smollm2" else (model if os.path.isfile(model) else None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagevis-settings-") as settings_dir:
        if cold:
            files = [*package_files(), *([model_file] if model_file else [])]
            asked = evict_from_page_cache(files)
            rows.append({"run": "cold", "evicted_bytes": asked, "still_cached_bytes": cached_bytes(files),
                         **start_once(argv, settings_dir)})
        for i in range(warm_runs):
            if not cold and i == 0:
                start_once(argv, settings_dir)  # a warm-up start, not counted
            rows.append({"run": "warm", **start_once(argv, settings_dir)})
    return rows


def format_rows(rows: list[dict], label: str) -> str:
    """Each phase's end (seconds since spawn; and the process's CPU seconds then), then where the time went."""
    head = f"{'run':<10} " + " ".join(f"{p:>11}" for p in PHASES)
    out = [f"Startup: `pagevis --model {label}` to the first drawn frame (seconds since the process was spawned, "
           f"and CPU seconds the process had used by then; target ≤ {TARGET_WARM:g} s warm for SmolLM2)", head]
    for r in rows:
        for kind in ("phases", "cpu"):
            values = r[kind]
            name = r["run"] if kind == "phases" else "  CPU"
            out.append(f"{name:<10} " + " ".join(f"{values[p]:>11.2f}" if p in values else f"{'—':>11}"
                                                 for p in PHASES))
    for r in rows:
        if "still_cached_bytes" in r:
            out.append(f"cold: asked the kernel to drop {r['evicted_bytes'] / 2**20:.0f} MiB (the model and the app's "
                       f"packages); {r['still_cached_bytes'] / 2**20:.0f} MiB stayed cached (mapped by other processes)")
    warm = [r for r in rows if r["run"] == "warm"]
    if warm:
        best = min(warm, key=lambda r: r["phases"].get("ready_drawn", float("inf")))
        out.append("where the time goes (best warm run; each phase's own wall / CPU seconds): "
                   + " · ".join(f"{phase} {wall:.2f} / {cpu:.2f}" for phase, wall, cpu in spans(best)))
        first, cpu = best["phases"].get("first_paint", float("nan")), best["cpu"].get("first_paint", float("nan"))
        verdict = "meets" if first <= TARGET_WARM else "misses"
        out.append(f"first drawn frame, warm: {first:.2f} s ({verdict} the {TARGET_WARM:g} s target) after {cpu:.2f} s "
                   f"of CPU; ready session drawn: {best['phases'].get('ready_drawn', float('nan')):.2f} s. Where the "
                   "wall time is many times the CPU time, other processes held the cores: the CPU seconds are what a "
                   "free core would take")
    return "\n".join(out)


def spans(row: dict) -> list[tuple[str, float, float]]:
    """(phase, its own wall seconds, its own CPU seconds) in the order they ended (a model that loads fast is
    ready before the first paint); the first phase from the spawn."""
    result, wall, cpu = [], 0.0, 0.0
    for phase in sorted(row["phases"], key=row["phases"].get):
        result.append((phase, row["phases"][phase] - wall, row["cpu"][phase] - cpu))
        wall, cpu = row["phases"][phase], row["cpu"][phase]
    return result

"""Two threads for one weight product, without ever waiting for a core another process holds.

The kernels (weight_kernels.py) release the GIL and work on a range of row tiles. With two threads the caller
hands the upper part of the tiles to a helper thread and computes the lower part itself. Then:
  - the helper is done: its rows are copied in (both cores worked);
  - the helper has not started (its core is busy elsewhere): the caller takes the job back and does it;
  - the helper started but is still running well after the caller's own part took: the caller computes those
    tiles itself too and ignores the helper's copy (into its own buffer, never read).
So a product never takes much longer than on one thread, whatever else the machine runs: OpenMP-style workers
that spin or wait for a descheduled thread make a step many times slower on a busy machine (docs/model.md).
Small products (below MIN_SPLIT_BYTES of packed weights) stay on the caller: measured, splitting SmolLM2's 0.3-1 MB
products made two threads slower than one (31.9 vs 52.9 tok/s); the big ones (the output projection, a 1B model's
feed-forward) gain.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

import numpy as np

MIN_SPLIT_BYTES = 4 << 20  # below ~0.5 ms of work the hand-off (a thread wake-up, ~50-100 us loaded) costs more
PATIENCE = 0.5  # how long past the caller's own part's time the caller waits for the helper before doing it

_threads = 1
_helper: _Helper | None = None
_lock = threading.Lock()


def set_weight_threads(count: int | None) -> int:
    """Use count threads (1 or 2; None: every core, up to 2) for the weight products; returns the count set."""
    global _threads
    count = min(2, os.cpu_count() or 1) if count is None else count
    if count < 1:
        raise ValueError(f"weight threads must be at least 1, got {count}")
    _threads = min(2, count)
    return _threads


def weight_threads() -> int:
    return _threads


class _Job:
    __slots__ = ("run", "state", "done")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.state = "queued"  # queued -> running | taken; running -> done
        self.done = threading.Event()


class _Helper:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="pagevis-weights", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            with _lock:
                if job.state != "queued":
                    continue
                job.state = "running"
            job.run()
            job.done.set()


def split(tiles: int, packed_bytes: int, work: Callable[[int, int, bool], np.ndarray | None],
          place: Callable[[int, int, np.ndarray], None]) -> None:
    """Compute tiles 0..tiles: work(t0, t1, private) computes a range (into the output when private is False,
    else into a buffer it returns); place(t0, t1, buffer) copies a private result into the output."""
    global _helper
    if _threads < 2 or tiles < 2 or packed_bytes < MIN_SPLIT_BYTES:
        work(0, tiles, False)
        return
    if _helper is None:
        _helper = _Helper()
    middle = tiles // 2
    result: list[np.ndarray | None] = []
    job = _Job(lambda: result.append(work(middle, tiles, True)))
    _helper.jobs.put(job)
    start = time.perf_counter()
    work(0, middle, False)
    own = time.perf_counter() - start
    with _lock:
        if job.state == "queued":
            job.state = "taken"
    if job.state == "taken" or not job.done.wait(PATIENCE * own + 50e-6):
        work(middle, tiles, False)
        return
    place(middle, tiles, result[0])

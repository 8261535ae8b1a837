"""Two threads for one weight product, without ever waiting for a core another process holds.

One-row products (decode) do not come here on two threads: spin_pool.py shares every one of them, however small,
with a helper that waits in numba code instead of being woken (quantized.QuantMatrix.product). This split serves
the products of several rows (a batched step's, prefill's sgemm chunks) and the dense attention's.

The kernels (weight_kernels.py) release the GIL and work on a range of row tiles. With two threads a product's
tiles are cut into CHUNKS ranges that the caller and a helper thread take in turn (under a lock), each range
computed once by whoever takes it: the caller's into the output, the helper's into its own buffer, copied in by
the caller. Then:
  - both cores are free: the ranges go about half and half;
  - the helper has not started (its core is busy elsewhere): the caller takes every range, as one thread would,
    without waiting for it;
  - the helper took a range and is still on it when the caller has no range left: the caller waits for it up to
    PATIENCE times its own time for a range, then computes it itself and ignores the helper's copy (into its own
    buffer, never read).
So a product never takes much longer than on one thread, whatever else the machine runs: OpenMP-style workers
that spin or wait for a descheduled thread make a step many times slower on a busy machine (docs/model.md).
(The first version handed the upper half to the helper and waited for it: a helper that started late left the
caller waiting, then computing that half again.)
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
PATIENCE = 0.5  # how long, in its own time for a range, the caller waits for the helper's range before doing it
CHUNKS = 8  # ranges a split product is cut into

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


class _Share:
    """One product's ranges, taken in turn by the caller and the helper (under _lock)."""

    __slots__ = ("ranges", "work", "next", "closed", "busy", "results", "finished")

    def __init__(self, ranges: list[tuple[int, int]], work) -> None:
        self.ranges, self.work = ranges, work
        self.next = 0  # the first range nobody has taken
        self.closed = False  # the caller has no range left to take: the helper takes none either
        self.busy: int | None = None  # the range the helper is computing
        self.results: dict[int, np.ndarray] = {}  # the helper's ranges, computed
        self.finished = threading.Condition(_lock)

    def take(self, helper: bool) -> int | None:
        with _lock:
            if self.closed or self.next >= len(self.ranges):
                return None
            index, self.next = self.next, self.next + 1
            if helper:
                self.busy = index
            return index

    def help(self) -> None:
        """The helper's loop: ranges into its own buffers until none is left."""
        while (index := self.take(helper=True)) is not None:
            part = self.work(*self.ranges[index], True)
            with _lock:
                self.results[index], self.busy = part, None
                self.finished.notify()


class _Helper:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Share] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="pagevis-weights", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get().help()


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
    bounds = np.linspace(0, tiles, min(CHUNKS, tiles) + 1).astype(int)
    share = _Share([(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])], work)
    _helper.jobs.put(share)
    own, count = 0.0, 0
    while (index := share.take(helper=False)) is not None:
        start = time.perf_counter()
        work(*share.ranges[index], False)
        own, count = own + time.perf_counter() - start, count + 1
    with _lock:
        share.closed = True
        late = share.busy
        if late is not None:  # the helper is on a range: wait a little for it
            share.finished.wait_for(lambda: late in share.results, PATIENCE * own / max(count, 1) + 50e-6)
        ready = dict(share.results)
    if late is not None and late not in ready:
        work(*share.ranges[late], False)
    for index, part in ready.items():
        place(*share.ranges[index], part)

"""The weight threads' split: every range of tiles computed once and placed, whether the helper thread shares the
work, never starts (its core is busy elsewhere), or stalls on a range (then the caller computes that range itself
after a short wait, never the helper's whole share)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pagevis.model import weight_threads


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setattr(weight_threads, "MIN_SPLIT_BYTES", 0)
    weight_threads.set_weight_threads(2)
    yield
    weight_threads.set_weight_threads(1)


def product(tiles: int, stall: float = 0.0):
    """(out, calls, work, place) for a product whose tile t is t + 1; the helper's ranges (private) stall."""
    out = np.zeros(tiles)
    calls = []

    def work(t0, t1, private):
        calls.append((t0, t1, private, threading.current_thread().name))
        values = np.arange(t0, t1) + 1.0
        if private:
            time.sleep(stall)
            return values
        out[t0:t1] = values
        return None

    def place(t0, t1, part):
        out[t0:t1] = part

    return out, calls, work, place


def test_every_tile_is_computed_and_placed(two_threads):
    for tiles in (2, 3, 8, 17, 100):
        out, calls, work, place = product(tiles)
        weight_threads.split(tiles, 1, work, place)
        assert np.array_equal(out, np.arange(tiles) + 1.0)
        covered = sorted((t0, t1) for t0, t1, _, _ in calls)
        assert covered[0][0] == 0 and covered[-1][1] == tiles  # ranges cover the tiles, each once at most twice
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:]) if a != b)


class _Asleep:
    """A helper whose core never comes: its jobs are never taken."""

    class jobs:
        @staticmethod
        def put(job):
            pass


def test_a_helper_that_never_starts_costs_no_wait(two_threads, monkeypatch):
    monkeypatch.setattr(weight_threads, "_helper", _Asleep())
    out, calls, work, place = product(64, stall=1.0)
    started = time.perf_counter()
    weight_threads.split(64, 1, work, place)
    assert time.perf_counter() - started < 0.5 and np.array_equal(out, np.arange(64) + 1.0)
    assert all(not private for _, _, private, _ in calls)


def test_a_stalled_helper_range_is_computed_by_the_caller(two_threads):
    out, calls, work, place = product(64, stall=2.0)
    started = time.perf_counter()
    weight_threads.split(64, 1, work, place)
    assert time.perf_counter() - started < 1.5 and np.array_equal(out, np.arange(64) + 1.0)

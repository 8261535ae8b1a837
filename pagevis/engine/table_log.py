"""Per-layer tables (block tables, the RAM frame of each block) over a session's steps, kept as changes.

A StepRecord holds its step's tables as a view into this log, not as a copy: with a disk tier a layer's
block table grows to thousands of pages, and one copy per layer per step made a long run's records grow with
steps x pages. Here memory grows with what changed. Each layer keeps its changes (the slice of the previous
table replaced, and what replaced it) and, whenever the entries changed since the last checkpoint add up to
the table's length, a checkpoint of the whole table: so the log is at most about three times the entries that
ever changed plus one table, and rebuilding a step's table costs at most about two table lengths.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np


class _LayerLog:
    def __init__(self) -> None:
        self.current: tuple[int, ...] = ()
        self.steps: list[int] = []  # step of each change, ascending
        self.changes: list[tuple[int, int, tuple[int, ...]]] = []  # (start, end, inserted) into the previous
        self.checkpoints: list[tuple[int, int, tuple[int, ...]]] = [(-1, 0, ())]  # (step, changes before, table)
        self.checkpoint_steps: list[int] = [-1]  # their steps, for bisect
        self._since_checkpoint = 0
        self._cached: tuple[int, tuple[int, ...]] | None = None  # the last table rebuilt, by step

    def record(self, step: int, table) -> None:
        if isinstance(table, tuple):
            new = table
        else:  # the live lists of a cache's tables: unchanged most steps, compared at C speed before any copy
            if len(table) == len(self.current) and tuple(table) == self.current:
                return
            new = tuple(int(p) for p in table)
        if new == self.current:
            return
        start, end, inserted = _difference(self.current, new)
        self.steps.append(step)
        self.changes.append((start, end, inserted))
        self.current = new
        self._since_checkpoint += (end - start) + len(inserted)
        if self._since_checkpoint >= max(len(new), 16):
            self.checkpoints.append((step, len(self.changes), new))
            self.checkpoint_steps.append(step)
            self._since_checkpoint = 0

    def at(self, step: int) -> tuple[int, ...]:
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1]
        index = bisect_right(self.checkpoint_steps, step) - 1
        _, done, table = self.checkpoints[index]
        upto = bisect_right(self.steps, step)
        if upto > done:
            rows = list(table)
            for start, end, inserted in self.changes[done:upto]:
                rows[start:end] = inserted
            table = tuple(rows)
        self._cached = (step, table)
        return table


def _difference(old: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """(start, end, inserted) with old[:start] + inserted + old[end:] == new, the unchanged ends maximal."""
    a, b = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    start = int(differ[0]) if differ.size else n
    m = min(len(a), len(b)) - start
    differ = np.flatnonzero(a[len(a) - m:][::-1] != b[len(b) - m:][::-1]) if m else np.zeros(0, np.int64)
    tail = int(differ[0]) if differ.size else m
    return start, len(a) - tail, new[start: len(b) - tail]


class TableLog:
    """Every layer's table, step by step. `record(step, tables)` once per step; `at(step)` the view."""

    def __init__(self, n_layers: int):
        self._layers = [_LayerLog() for _ in range(n_layers)]

    def record(self, step: int, tables) -> TablesAt:
        for log, table in zip(self._layers, tables, strict=True):
            log.record(step, table)
        return TablesAt(self, step)

    def table(self, layer: int, step: int) -> tuple[int, ...]:
        return self._layers[layer].at(step)

    def __len__(self) -> int:
        return len(self._layers)

    def entries(self) -> int:
        """Table entries held (changes and checkpoints): what the log's memory grows with."""
        return sum(len(ins) for log in self._layers for _, _, ins in log.changes) + sum(
            len(table) for log in self._layers for _, _, table in log.checkpoints)


class TablesAt(Sequence):
    """One step's tables, per layer (a read-only sequence of tuples, rebuilt from the log on access)."""

    __slots__ = ("_log", "step")

    def __init__(self, log: TableLog, step: int):
        self._log, self.step = log, step

    def __len__(self) -> int:
        return len(self._log)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return tuple(self[i] for i in range(*layer.indices(len(self))))
        if layer < 0:
            layer += len(self)
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        return self._log.table(layer, self.step)

    def __iter__(self):  # (Sequence's own calls __getitem__ with its checks per layer: the app iterates every step)
        step = self.step
        return iter([layer.at(step) for layer in self._log._layers])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            tuple(a) == tuple(b) for a, b in zip(self, other))

    def __hash__(self):
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"TablesAt(step={self.step}, {tuple(self)!r})"

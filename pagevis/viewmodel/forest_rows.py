"""What the prefix forest view renders (no Qt): `ForestRows`, columns of (parent row, tokens, colour class, flags,
sibling order) with callables for a row's key, hover text and label; `ForestRow` and `ForestRows.from_rows` for a
few thousand plain rows. Producers (the attach window's adapter, a server window) build these; the view
(prefix_forest.py) and the layout (forest_layout.py) never see where the blocks came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

NEWEST, REMOVED, HOT, SHARED = 1, 2, 4, 8  # flags
FLAG_NAMES = {NEWEST: "newest stored", REMOVED: "just removed", HOT: "hot (stored again soon after removal)",
              SHARED: "held by another engine too"}


@dataclass(frozen=True)
class ColourClass:
    name: str
    color: str  # "#rrggbb"


@dataclass(frozen=True)
class ForestRow:
    """One node, for `ForestRows.from_rows`: `parent` is the parent's key (None, or a key not given: a root),
    `colour` an index into the classes, `text` the hover text."""

    key: Hashable
    parent: Hashable | None
    tokens: int
    colour: int
    text: str = ""
    flags: int = 0
    label: str = ""
    order: int = 0


def _default_label(row: int) -> str:
    return ""


@dataclass(frozen=True)
class ForestRows:
    """What the view renders, one entry per node (NumPy columns, so a million rows cost no Python objects)."""

    parent: np.ndarray  # int64 row of the parent, -1 for a root
    tokens: np.ndarray  # int64 width of the box
    colour: np.ndarray  # uint8 index into `classes`
    flags: np.ndarray  # uint8: NEWEST | REMOVED | HOT | SHARED
    order: np.ndarray  # int64 sibling order, smaller first (e.g. when the block was stored)
    classes: tuple[ColourClass, ...]
    key: Callable[[int], Hashable]  # a row's key (what `row_of` finds)
    describe: Callable[[int], str]  # a row's hover text
    label: Callable[[int], str] = _default_label  # drawn inside boxes wide enough for it
    meta: dict = field(default_factory=dict)  # whatever the producer wants to keep beside (not drawn)

    def __len__(self) -> int:
        return len(self.parent)

    @classmethod
    def empty(cls, classes: tuple[ColourClass, ...] = ()) -> "ForestRows":
        z = np.zeros(0, np.int64)
        return cls(z, z, np.zeros(0, np.uint8), np.zeros(0, np.uint8), z, classes, lambda i: None, lambda i: "")

    @classmethod
    def from_rows(cls, rows: Sequence[ForestRow], classes: Sequence[ColourClass]) -> "ForestRows":
        keys = [row.key for row in rows]
        index = {key: i for i, key in enumerate(keys)}
        parent = np.array([index.get(row.parent, -1) if row.parent is not None else -1 for row in rows],
                          dtype=np.int64)
        texts = [row.text for row in rows]
        labels = [row.label for row in rows]
        return cls(parent=parent, tokens=np.array([row.tokens for row in rows], dtype=np.int64),
                   colour=np.array([row.colour for row in rows], dtype=np.uint8),
                   flags=np.array([row.flags for row in rows], dtype=np.uint8),
                   order=np.array([row.order for row in rows], dtype=np.int64), classes=tuple(classes),
                   key=keys.__getitem__, describe=texts.__getitem__, label=labels.__getitem__)

    def blocks(self) -> np.ndarray:
        """Rows that are blocks held now (the REMOVED ones are ghosts, drawn for one frame)."""
        return (self.flags & REMOVED) == 0

    def count_by_class(self) -> dict[str, int]:
        counts = np.bincount(self.colour[self.blocks()], minlength=len(self.classes))
        return {c.name: int(n) for c, n in zip(self.classes, counts) if n}

    def subset(self, rows: np.ndarray) -> "ForestRows":
        """These rows only (a parent outside them makes a root), with keys, texts and labels of the originals."""
        rows = np.asarray(rows, dtype=np.int64)
        new = np.full(len(self.parent), -1, np.int64)
        new[rows] = np.arange(len(rows))
        parent = self.parent[rows]
        parent = np.where(parent >= 0, new[np.maximum(parent, 0)], -1)
        original = rows.tolist()
        key, describe, label = self.key, self.describe, self.label
        return ForestRows(parent=parent, tokens=self.tokens[rows], colour=self.colour[rows], flags=self.flags[rows],
                          order=self.order[rows], classes=self.classes, key=lambda i: key(original[i]),
                          describe=lambda i: describe(original[i]), label=lambda i: label(original[i]),
                          meta={**self.meta, "original_rows": rows})

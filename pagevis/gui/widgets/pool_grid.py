"""The shared pool as a grid of pages (layer 0): the Sequences window's and the Server window's pool.

A sequence's (or request's) own page is drawn in its owner's colour with its id, a shared page in amber with
its reference count, a free page still holding a cached prefix in slate (labelled with its place in the reuse
queue), an empty page dark; a page allocated but not yet written is dimmed. The windows differ only in how
owners are coloured (a small palette of sequences, or a hue per request) and in the number of columns.

The main window's PageGridView (page_grid.py) stays its own widget: it draws one sequence's slots inside each
page (age / score shading, holes, protected slots, the selected layer), not pages shared between owners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.cells import STATE_COLORS

SHARED_COLOR = "#ffb020"
CACHED_COLOR = "#4a5568"
FREE_COLOR = STATE_COLORS[0]
INK = "#0b0c0f"  # labels on coloured pages


@dataclass(frozen=True)
class PageCell:
    page: int
    state: str  # "free", "cached" (free, holds a cached prefix), "private", "shared"
    owners: tuple[int, ...]
    ref_count: int
    fill: int
    queue_index: int = -1  # place in the cached free queue (0 = reused first)

    @property
    def label(self) -> str:
        if self.state == "shared":
            return f"×{self.ref_count}"
        if self.state == "private":
            return str(self.owners[0])
        return f"c{self.queue_index}" if self.state == "cached" else ""


def page_cells(record, owner_of: dict[int, int] | None = None) -> tuple[PageCell, ...]:
    """What the pool grid draws for each page of layer 0 of a BatchRecord; `owner_of` renames the record's
    sequence ids (the Server window's request ids)."""
    owners: dict[int, list[int]] = {}
    for seq_id, table in record.block_tables.items():
        for page in table:
            owners.setdefault(page, []).append(seq_id if owner_of is None else owner_of[seq_id])
    queue = {page: i for i, page in enumerate(record.cached_free)}
    cells = []
    for page, refs in enumerate(record.ref_counts.tolist()):
        who = tuple(owners.get(page, ()))
        state = "shared" if refs > 1 else "private" if refs == 1 else "cached" if page in queue else "free"
        cells.append(PageCell(page, state, who, refs, int(record.fill[page]), queue.get(page, -1)))
    return tuple(cells)


class PoolGrid(QWidget):
    """Pages as squares, row by row: `show_state(cells)` draws a tuple of PageCells."""

    def __init__(self, owner_color: Callable[[int], str], columns: int | None = None, empty_text: str = "",
                 minimum: QSize = QSize(240, 120)):
        super().__init__()
        self.owner_color = owner_color
        self.columns = columns  # None: as many as make the squares largest in the widget's shape
        self.empty_text = empty_text
        self.cells: tuple[PageCell, ...] = ()
        self.setMinimumSize(minimum)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Expanding)

    def show_state(self, cells: tuple[PageCell, ...]) -> None:
        self.cells = cells
        self.update()

    def color(self, cell: PageCell) -> str:
        if cell.state == "shared":
            return SHARED_COLOR
        if cell.state == "private":
            return self.owner_color(cell.owners[0])
        return CACHED_COLOR if cell.state == "cached" else FREE_COLOR

    def _columns(self) -> int:
        if self.columns is not None:
            return self.columns
        n = max(len(self.cells), 1)
        aspect = max(self.width() - 4, 1) / max(self.height() - 4, 1)
        return max(1, min(n, int(np.ceil(np.sqrt(n * aspect)))))

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        if not self.cells:
            painter.setPen(QColor(theme.MUTED))
            painter.drawText(self.rect(), Qt.AlignCenter, self.empty_text)
            painter.end()
            return
        columns = self._columns()
        rows = -(-len(self.cells) // columns)
        side = max(2.0, min((self.width() - 4) / columns, (self.height() - 4) / rows))
        gap = 2.0 if side >= 12 else 1.0 if side >= 6 else 0.0
        font = painter.font()
        font.setPointSizeF(max(5.0, side / 3.2))
        painter.setFont(font)
        for cell in self.cells:
            row, col = divmod(cell.page, columns)
            rect = QRectF(2 + col * side, 2 + row * side, side - gap, side - gap)
            owned = cell.state in ("private", "shared")
            color = QColor(self.color(cell))
            painter.fillRect(rect, color.darker(160) if owned and cell.fill == 0 else color)
            if cell.label and side >= 14:
                painter.setPen(QColor(INK if owned else theme.TEXT))
                painter.drawText(rect, Qt.AlignCenter, cell.label)
        painter.end()

"""The sequences view: one shared pool seen from many sequences (renders a BatchRecord, layer 0).

The pool grid colours each page by its owner; a shared page is drawn in the shared colour with its
reference count; a free page that still holds a cached prefix is marked with its place in the reuse queue.
Beside it: every sequence's block table side by side, the memory panel (pages used against what the same
sequences would take without sharing and what contiguous per-sequence allocation would reserve), and the
sequences' continuations side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QLabel, QSizePolicy, QSplitter, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from pagevis.gui.widgets import theme

SHARED_COLOR = "#ffb020"
CACHED_COLOR = "#4a5568"
FREE_COLOR = theme.STATE_COLORS[0]


def owner_color(seq_id: int) -> str:
    palette = (theme.SERIES[0], theme.SERIES[2], theme.SERIES[4], theme.SERIES[5], "#e86fb0", "#9bd15a")
    return palette[seq_id % len(palette)]


@dataclass(frozen=True)
class PageCell:
    page: int
    state: str  # "free", "cached" (free, holds a cached prefix), "private", "shared"
    owners: tuple[int, ...]
    ref_count: int
    fill: int
    queue_index: int = -1  # place in the cached free queue (0 = reused first)

    @property
    def color(self) -> str:
        if self.state == "shared":
            return SHARED_COLOR
        if self.state == "private":
            return owner_color(self.owners[0])
        return CACHED_COLOR if self.state == "cached" else FREE_COLOR

    @property
    def label(self) -> str:
        if self.state == "shared":
            return f"×{self.ref_count}"
        if self.state == "private":
            return str(self.owners[0])
        return f"c{self.queue_index}" if self.state == "cached" else ""


def page_cells(record) -> list[PageCell]:
    """What the pool grid draws for each page of layer 0."""
    owners: dict[int, list[int]] = {}
    for seq_id, table in record.block_tables.items():
        for page in table:
            owners.setdefault(page, []).append(seq_id)
    queue = {page: i for i, page in enumerate(record.cached_free)}
    cells = []
    for page, refs in enumerate(record.ref_counts.tolist()):
        who = tuple(owners.get(page, ()))
        state = "shared" if refs > 1 else "private" if refs == 1 else "cached" if page in queue else "free"
        cells.append(PageCell(page, state, who, refs, int(record.fill[page]), queue.get(page, -1)))
    return cells


def memory_rows(record, page_size: int) -> list[tuple[str, int]]:
    """(label, pages) for the memory panel: paged with sharing, without, contiguous reservation."""
    return [("paged, shared", record.pages_used), ("paged, no sharing", record.pages_unshared),
            ("contiguous reservation", -(-record.contiguous_reserved_tokens // page_size))]


def peak_rows(before: list[tuple[str, int]], record, page_size: int) -> list[tuple[str, int]]:
    """memory_rows' largest values so far: those `before` it (empty at the first step) and the record's own
    (the README's table compares peaks)."""
    rows = memory_rows(record, page_size)
    return [(label, max(pages, dict(before).get(label, 0))) for label, pages in rows]


class PoolGrid(QWidget):
    """Pages as squares, row by row; each coloured by owner, labelled with owner / ref count / queue place."""

    COLUMNS = 16

    def __init__(self):
        super().__init__()
        self.cells: list[PageCell] = []
        self.setMinimumSize(QSize(320, 160))
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Expanding)

    def set_cells(self, cells: list[PageCell]) -> None:
        self.cells = cells
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        if not self.cells:
            painter.setPen(QColor(theme.MUTED))
            painter.drawText(self.rect(), Qt.AlignCenter, "start sequences to see the shared pool")
            return
        rows = -(-len(self.cells) // self.COLUMNS)
        side = max(4.0, min((self.width() - 4) / self.COLUMNS, (self.height() - 4) / rows))
        font = painter.font()
        font.setPointSizeF(max(5.0, side / 3.2))
        painter.setFont(font)
        for cell in self.cells:
            row, col = divmod(cell.page, self.COLUMNS)
            rect = QRectF(2 + col * side, 2 + row * side, side - 2, side - 2)
            color = QColor(cell.color)
            if cell.state in ("private", "shared") and cell.fill == 0:
                color = color.darker(160)
            painter.fillRect(rect, color)
            if cell.label and side >= 14:
                painter.setPen(QColor("#0b0c0f") if cell.state in ("private", "shared") else QColor(theme.TEXT))
                painter.drawText(rect, Qt.AlignCenter, cell.label)


class MemoryBars(QWidget):
    """Horizontal bars: pages per way of allocating the same sequences."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[str, int]] = []
        self.peaks: list[tuple[str, int]] = []
        self.setMinimumHeight(70)

    def set_rows(self, rows: list[tuple[str, int]], peaks: list[tuple[str, int]] | None = None) -> None:
        self.rows, self.peaks = rows, peaks or rows
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.PANEL))
        if not self.rows:
            return
        top = max(max(pages for _, pages in self.peaks), 1)
        height = self.height() / len(self.rows)
        label_w = 290
        for i, ((label, pages), (_, peak)) in enumerate(zip(self.rows, self.peaks, strict=True)):
            y = i * height
            painter.setPen(QColor(theme.TEXT))
            painter.drawText(QRectF(4, y, label_w, height), Qt.AlignVCenter, f"{label}: {pages} (peak {peak})")
            color = QColor((SHARED_COLOR, theme.SERIES[0], theme.SERIES[3])[i % 3])
            room = self.width() - label_w - 8
            painter.fillRect(QRectF(label_w + 4, y + height * 0.2, room * peak / top, height * 0.6), color.darker(250))
            painter.fillRect(QRectF(label_w + 4, y + height * 0.2, room * pages / top, height * 0.6), color)


class SequencesView(QWidget):
    title = "Sequences"

    def __init__(self):
        super().__init__()
        self.grid = PoolGrid()
        self.tables = QTableWidget()
        self.tables.setEditTriggers(QTableWidget.NoEditTriggers)
        self.tables.verticalHeader().setDefaultSectionSize(18)
        self.legend = QLabel(
            f"<span style='color:{SHARED_COLOR}'>■</span> shared page (×ref count) &nbsp; "
            f"<span style='color:{owner_color(0)}'>■</span><span style='color:{owner_color(1)}'>■</span> "
            f"a sequence's own page (its id) &nbsp; <span style='color:{CACHED_COLOR}'>■</span> free, cached "
            f"prefix (cN: reuse order) &nbsp; <span style='color:{FREE_COLOR}'>■</span> free (layer 0)")
        self.legend.setWordWrap(True)
        self.queue = QLabel()
        self.queue.setWordWrap(True)
        self.memory = MemoryBars()
        self.memory_note = QLabel()
        self.memory_note.setWordWrap(True)
        self.texts = QTableWidget()
        self.texts.setEditTriggers(QTableWidget.NoEditTriggers)
        self.texts.setWordWrap(True)
        self.texts.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.texts.verticalHeader().setVisible(False)
        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.grid, 3)
        column.addWidget(self.legend)
        column.addWidget(self.queue)
        column.addWidget(self.memory)
        column.addWidget(self.memory_note)
        top = QSplitter(Qt.Horizontal)
        top.addWidget(left)
        top.addWidget(self.tables)
        split = QSplitter(Qt.Vertical)
        split.addWidget(top)
        split.addWidget(self.texts)
        split.setSizes([500, 200])
        layout = QHBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(split)
        self.record = None

    def show_record(self, record, page_size: int, texts: dict[int, str], peaks=None) -> None:
        """Render one BatchRecord; texts: every sequence's continuation so far (finished ones too); peaks:
        the memory rows' largest values up to it (peak_rows)."""
        self.record = record
        self.grid.set_cells(page_cells(record))
        self._fill_tables(record)
        queue = ", ".join(str(p) for p in record.cached_free[:24])
        more = f" … (+{len(record.cached_free) - 24})" if len(record.cached_free) > 24 else ""
        self.queue.setText(f"cached free queue (reused first →): {queue or 'empty'}{more}")
        self.memory.set_rows(memory_rows(record, page_size), peaks)
        slots = record.pages_used * page_size
        internal = slots - record.tokens_stored
        self.memory_note.setText(
            f"{record.tokens_stored} tokens in {record.pages_used} pages: {internal} empty slots "
            f"({internal / slots:.0%} internal fragmentation, only in last pages); no external fragmentation "
            f"(any free page fits any sequence). Contiguous allocation reserves prompt + max new tokens per "
            f"sequence up front." if slots else "no pages in use")
        self.texts.setColumnCount(len(texts))
        self.texts.setRowCount(1)
        self.texts.setHorizontalHeaderLabels([f"sequence {s}" for s in texts])
        for column, text in enumerate(texts.values()):
            self.texts.setItem(0, column, QTableWidgetItem(text))
        self.texts.resizeRowsToContents()

    def _fill_tables(self, record) -> None:
        tables = record.block_tables
        self.tables.setColumnCount(len(tables))
        self.tables.setRowCount(max((len(t) for t in tables.values()), default=0))
        self.tables.setHorizontalHeaderLabels([f"seq {s}" for s in tables])
        for column, (seq_id, table) in enumerate(tables.items()):
            for row, page in enumerate(table):
                refs = int(record.ref_counts[page])
                item = QTableWidgetItem(f"{page}" + (f" ×{refs}" if refs > 1 else ""))
                item.setBackground(QColor(SHARED_COLOR if refs > 1 else owner_color(seq_id)))
                item.setForeground(QColor("#0b0c0f"))
                self.tables.setItem(row, column, item)

"""The sequences view: one shared pool seen from many sequences (renders a BatchRecord, layer 0).

The pool grid (widgets/pool_grid.py) colours each page by its owner; a shared page is drawn in the shared
colour with its reference count; a free page that still holds a cached prefix is marked with its place in the
reuse queue. Beside it: every sequence's block table side by side, the memory panel (pages used against what the same
sequences would take without sharing and what contiguous per-sequence allocation would reserve), and the
sequences' continuations side by side.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import (QHeaderView, QLabel, QTableWidget, QTableWidgetItem,
                               QWidget)

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import splitter, stacked
from pagevis.gui.widgets.pool_grid import CACHED_COLOR, FREE_COLOR, INK, SHARED_COLOR, PoolGrid, page_cells
from pagevis.viewmodel.sequences_step import SequencesStep, memory_rows

def owner_color(seq_id: int) -> str:
    palette = (theme.SERIES[0], theme.SERIES[2], theme.SERIES[4], theme.SERIES[5], "#e86fb0", "#9bd15a")
    return palette[seq_id % len(palette)]


class MemoryBars(QWidget):
    """Horizontal bars: pages per way of allocating the same sequences."""

    def __init__(self):
        super().__init__()
        self.rows: tuple[tuple[str, int], ...] = ()
        self.peaks: tuple[tuple[str, int], ...] = ()
        self.setMinimumHeight(70)

    def show_state(self, rows: tuple[tuple[str, int], ...], peaks: tuple[tuple[str, int], ...] = ()) -> None:
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
        self.grid = PoolGrid(owner_color, columns=16, empty_text="start sequences to see the shared pool",
                             minimum=QSize(320, 160))
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
        self.texts.setVerticalScrollMode(QTableWidget.ScrollPerPixel)  # a row taller than the view: its end
        left = stacked((self.grid, 3), self.legend, self.queue, self.memory, self.memory_note)
        top = splitter(Qt.Horizontal, left, self.tables)
        stacked(splitter(Qt.Vertical, top, self.texts, sizes=[500, 200]), margins=(2, 2, 2, 2), into=self)
        self.record = None

    def show_state(self, snapshot: SequencesStep) -> None:
        record, page_size, texts = snapshot.record, snapshot.page_size, dict(snapshot.texts)
        self.record = record
        self.grid.show_state(page_cells(record))
        self._fill_tables(record)
        queue = ", ".join(str(p) for p in record.cached_free[:24])
        more = f" … (+{len(record.cached_free) - 24})" if len(record.cached_free) > 24 else ""
        self.queue.setText(f"cached free queue (reused first →): {queue or 'empty'}{more}")
        self.memory.show_state(memory_rows(record, page_size), snapshot.peaks)
        slots = record.pages_used * page_size
        internal = slots - record.tokens_stored
        self.memory_note.setText(
            f"{record.tokens_stored} tokens in {record.pages_used} pages: {internal} empty slots "
            f"({internal / slots:.0%} internal fragmentation, only in last pages); no external fragmentation "
            f"(any free page fits any sequence). Contiguous allocation reserves prompt + max new tokens per "
            f"sequence up front." if slots else "no pages in use")
        if record.hybrid is not None:  # sliding-window layers: what they save against a cache without windows
            self.memory_note.setText(f"{self.memory_note.text()}\nAll layers: {record.hybrid.text()}.")
        self.texts.setColumnCount(len(texts))
        self.texts.setRowCount(1)
        self.texts.setHorizontalHeaderLabels([f"sequence {s}" for s in texts])
        for column, text in enumerate(texts.values()):
            self.texts.setItem(0, column, QTableWidgetItem(text))
        self.texts.resizeRowsToContents()
        bar = self.texts.verticalScrollBar()  # the newest tokens, at the texts' end (they were cut off below)
        bar.setValue(bar.maximum())

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
                item.setForeground(QColor(INK))
                self.tables.setItem(row, column, item)

"""The page grid's block table: logical page → physical page of one layer, with the token positions each holds."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHeaderView, QTableWidget, QTableWidgetItem

MIN_TABLE_WIDTH, MAX_TABLE_WIDTH = 200, 280  # the block table's width, pixels
PAGES_NOTE = ("Pages are per layer: every layer has its own pages and block table, since each layer's policy "
              "evicts on its own (vLLM's block table is shared by every layer). A token-level policy (sinks, H2O, "
              "TOVA, …) writes the next token into the slot it evicted, so one page can hold positions far apart "
              "(\"0–3, 188–191\"); vLLM never does that — only oldest-page, which evicts whole pages, behaves "
              "like vLLM.")


class BlockTable(QTableWidget):
    """Logical page → physical page of one layer, with the token positions each page holds. A C++ item
    model: repainting it calls no Python, and only cells whose text changed are touched. The logical page
    is the row's header (a narrow column of its own), which leaves the positions the width they need."""

    HEADERS = ("physical", "tokens", "positions")

    def __init__(self):
        super().__init__(0, len(self.HEADERS))
        self.rows: list[tuple[int, int, int, str]] = []  # (logical, physical, tokens, positions) per row
        self._longest = 0  # characters of the longest positions text the column was fitted to
        self.widest = MAX_TABLE_WIDTH  # the most width the table takes (the page grid narrows it)
        self.setHorizontalHeaderLabels(self.HEADERS)
        for column in range(len(self.HEADERS)):
            self.horizontalHeaderItem(column).setToolTip(PAGES_NOTE)
        self.setToolTip(PAGES_NOTE)
        self.setEditTriggers(QTableWidget.NoEditTriggers)
        self.verticalHeader().setDefaultSectionSize(20)
        self.verticalHeader().setDefaultAlignment(Qt.AlignRight | Qt.AlignVCenter)
        self.resizeColumnsToContents()  # the headers' width before any row (a loading session's empty table)
        # widths fitted when the row count changes, not on every cell change (ResizeToContents measured every
        # cell of the table whenever one text changed, i.e. every step)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.Interactive)
        self.horizontalHeader().setStretchLastSection(True)

    def _fit(self, runs: str) -> str:
        """A positions run list ("41, 44, 145–147, 149, +2 more runs") cut to the runs that fit the positions
        column, the rest counted ("41, 44 +4"); the cell's tooltip has it whole. Token-level policies (H2O,
        TOVA) scatter a page's positions: their lists were cut mid-run ("+4 more ru")."""
        visible = self.viewport().width() - self.columnViewportPosition(2)  # a vertical scroll bar takes some
        room = min(self.columnWidth(2), visible) - 12
        metrics = self.fontMetrics()
        if room <= 0 or metrics.horizontalAdvance(runs) <= room:
            return runs
        parts = runs.split(", ")
        extra = int(parts.pop()[1:].split()[0]) if parts[-1].startswith("+") else 0
        for keep in range(len(parts) - 1, 0, -1):
            text = f"{', '.join(parts[:keep])} +{extra + len(parts) - keep}"
            if metrics.horizontalAdvance(text) <= room:
                return text
        return f"{parts[0]} +{extra + len(parts) - 1}"

    def refit(self) -> None:
        """Fit every row's positions to the column's width again (after the table changed size)."""
        for r, row in enumerate(self.rows):
            item = self.item(r, 2)
            if item is not None:
                item.setText(self._fit(row[3]))
                item.setToolTip(f"positions {row[3]}" if item.text() != row[3] else "")

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.refit()

    def set_rows(self, rows: list[tuple[int, int, int, str]]) -> None:
        if rows == self.rows:
            return
        resize = len(rows) != self.rowCount()
        if resize:
            self.setRowCount(len(rows))
        # a run list longer than any so far (token-level policies scatter positions) widens its column too
        longest = max((len(row[3]) for row in rows), default=0)
        if resize or longest > self._longest:
            resize, self._longest = True, longest
        for r, row in enumerate(rows):
            old = self.rows[r] if r < len(self.rows) else None
            if old is None or old[0] != row[0]:
                self.setVerticalHeaderItem(r, QTableWidgetItem(str(row[0])))
            for c, value in enumerate(row[1:]):
                if old is not None and old[c + 1] == value:
                    continue
                item = self.item(r, c)
                if item is None:
                    item = QTableWidgetItem()
                    if c < 2:
                        item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                    self.setItem(r, c, item)
                item.setText(str(value) if c < 2 else self._fit(str(value)))
                if c == 2:
                    item.setToolTip(f"positions {value}" if item.text() != value else "")
        self.rows = rows
        if resize:
            self.resizeColumnsToContents()
            # as wide as its columns (within the page grid's bounds): beside a stretching grid, the table got
            # its size hint and cut the longest positions
            need = (self.verticalHeader().sizeHint().width() + self.verticalScrollBar().sizeHint().width()
                    + sum(self.columnWidth(c) for c in range(self.columnCount())) + 2 * self.frameWidth())
            self.setMinimumWidth(min(max(need, MIN_TABLE_WIDTH), self.widest))
            self.refit()

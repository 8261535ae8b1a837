"""Eviction events: a filterable table of every eviction up to the selected step, and a timeline plot of
which positions were evicted when."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSortFilterProxyModel, Qt
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QHeaderView, QLineEdit, QSplitter, QTableView,
                               QVBoxLayout, QWidget)

from pagevis.gui.widgets import theme
from pagevis.viewmodel.cells import STATE_COLORS
from pagevis.viewmodel.view_state import ViewState

COLUMNS = ("step", "layer", "page", "slot", "position", "token", "reason", "score")
HEADERS = ("step", "layer", "page", "slot", "pos", "token", "reason", "score")


_RIGHT = Qt.AlignRight | Qt.AlignVCenter
MAX_ROWS = 200  # the table holds the newest evictions (of the selected layer, or of all) up to the selected step
# (the plot shows them all)
_NUMERIC = (0, 1, 2, 3, 4, 7)  # right-aligned columns


def _cells(event) -> tuple[str, ...]:
    """The displayed text of one eviction's row."""
    return (str(event.step), str(event.layer), str(event.page), str(event.slot), str(event.position),
            repr(event.token)[1:-1], event.reason, "" if np.isnan(event.score) else f"{event.score:.3g}")  # 3 digits: the score column fits them


class EventTableModel(QStandardItemModel):
    """Rows are the timeline's evictions start..limit (at most MAX_ROWS). A C++ item model, so painting the table calls no Python
    (a Python `data()` was ~1000 calls per repaint). Growing the limit inserts the new rows in one call,
    moving it back removes rows from the end. A row's cells are filled only once the filter shows it
    (`fill`): with "selected layer only", one row in n_layers is ever filled."""

    def __init__(self):
        super().__init__(0, len(COLUMNS))
        for column, header in enumerate(HEADERS):
            item = QStandardItem(header)
            if column < 5:
                item.setToolTip(f"filter with {COLUMNS[column]}=value")
            self.setHorizontalHeaderItem(column, item)
        self.events: list = []
        self.start = 0  # the event of row 0
        self.limit = 0
        self.shown: list = []  # the rows' events, events[start:limit]
        self._filled: list[bool] = []  # per row: its cells hold their text

    def show(self, events, limit: int, accepts) -> None:
        """Rows for events[start:limit], start = limit - MAX_ROWS or 0; the new ones that `accepts(event)` are
        filled at once. A longer session slides the window: the rows are then made afresh."""
        start = max(0, limit - MAX_ROWS)
        if events is not self.events or start != self.start:
            self.removeRows(0, self.rowCount())
            self.events, self.start, self.limit, self._filled, self.shown = events, start, start, [], []
        if limit < self.limit:
            self.removeRows(limit - start, self.limit - limit)
            del self._filled[limit - start:]
            del self.shown[limit - start:]
            self.limit = limit
        elif limit > self.limit:
            first, self.limit = self.limit, limit
            self._filled.extend([False] * (limit - first))
            self.shown.extend(events[first:limit])  # one vectorised read of the new rows' events
            self.insertRows(first - start, limit - first)  # the filter proxy looks each new row's event up
            self.fill(accepts, first - start)

    def fill(self, accepts, start: int = 0) -> None:
        """Give the rows from `start` that `accepts(event)` their cells, if they have none yet. Signals are
        held back while the cells are set (each would make the proxy and the view re-map the row) and one
        dataChanged covers them all."""
        filled, shown = self._filled, self.shown
        first = last = -1
        blocked = self.blockSignals(True)
        try:
            for row in range(start, len(shown)):
                if not filled[row] and accepts(shown[row]):
                    filled[row] = True
                    first, last = (row if first < 0 else first), row
                    for column, text in enumerate(_cells(shown[row])):
                        item = QStandardItem(text)
                        if column in _NUMERIC:
                            item.setTextAlignment(_RIGHT)
                        self.setItem(row, column, item)
        finally:
            self.blockSignals(blocked)
        if first >= 0:
            self.dataChanged.emit(self.index(first, 0), self.index(last, len(COLUMNS) - 1))

    def row(self, index: int) -> tuple:
        e = self.shown[index]
        return (e.step, e.layer, e.page, e.slot, e.position, e.token, e.reason, e.score)


class EventFilter(QSortFilterProxyModel):
    """Text filter over token and reason (or `field=value`, e.g. `layer=3`, `page=2`), and a layer filter.
    Rows are filtered by their event, not by their cells' text, so it is not re-run when cells are set."""

    def __init__(self):
        super().__init__()
        self.text = ""
        self.layer: int | None = None
        self.setDynamicSortFilter(False)

    def set_filter(self, text: str, layer: int | None) -> bool:
        """Apply a filter; True if it changed."""
        text = text.strip()
        if (text, layer) == (self.text, self.layer):
            return False
        if hasattr(self, "beginFilterChange"):  # Qt >= 6.10
            self.beginFilterChange()
            self.text, self.layer = text, layer
            self.endFilterChange()
        else:
            self.text, self.layer = text, layer
            self.invalidateFilter()
        return True

    def filterAcceptsRow(self, row: int, parent) -> bool:
        return self.accepts(self.sourceModel().shown[row])

    def accepts(self, event) -> bool:
        if self.layer is not None and event.layer != self.layer:
            return False
        if not self.text:
            return True
        for term in self.text.split():
            field, _, value = term.partition("=")
            if value and field in COLUMNS:
                if str(getattr(event, field)) != value:
                    return False
            elif term.lower() not in f"{event.token} {event.reason}".lower():
                return False
        return True


def _dashes(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each point (x, y) as a pair of points from y - 0.5 to y + 0.5: a dash one position high."""
    return np.repeat(x, 2), (np.repeat(y, 2).reshape(-1, 2) + (-0.5, 0.5)).ravel()


class EventsView(QWidget):
    title = "Eviction events"
    live_interval = 1.0  # while decoding, refresh at most once a second (a table is read, not watched)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model = EventTableModel()
        self.proxy = EventFilter()
        self.proxy.setSourceModel(self.model)
        self._key = None
        self._state = ViewState()

        self.filter = QLineEdit()
        self.filter.setPlaceholderText("filter: token or reason text, or field=value (page=3 position=12)")
        self.filter.setClearButtonEnabled(True)
        self._layer_events = None  # ((timeline id, layer), that layer's evictions) for "selected layer only"
        self.only_layer = QCheckBox("selected layer only")
        self.only_layer.setChecked(True)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(False)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Interactive)
        header.setMinimumSectionSize(24)
        for column, width in enumerate((38, 38, 36, 32, 40, 60, 150, 64)):  # a score: '0.004254'
            self.table.setColumnWidth(column, width)
        # the reason takes the room left ("slid out of the window (512)" was cut beside an empty score column)
        header.setStretchLastSection(False)
        header.setSectionResizeMode(COLUMNS.index("reason"), QHeaderView.Stretch)

        self.graphics = pg.GraphicsLayoutWidget()
        self.plot = self.graphics.addPlot()
        theme.style_plot(self.plot)  # the title names the axes: its plot keeps the height a label would take
        self.plot.setMenuEnabled(False)
        # one short vertical dash per eviction, drawn as a single path (connect="pairs"): a ScatterPlotItem
        # costs microseconds per point in Python, which made a scrub at 10 000 steps twice as slow as at 1 000
        self.scatter = pg.PlotCurveItem(pen=pg.mkPen(STATE_COLORS[5], width=3), connect="pairs")
        theme.cache_item(self.scatter)
        self.plot.addItem(self.scatter)
        self.cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=pg.QtCore.Qt.DashLine))
        self.plot.addItem(self.cursor)

        self.filter.textChanged.connect(lambda *_: self._refilter())
        self.only_layer.toggled.connect(lambda *_: self._refilter())
        self.only_layer.toggled.connect(self._show_layer_column)
        self._show_layer_column(self.only_layer.isChecked())
        top = QHBoxLayout()
        top.addWidget(self.filter, 1)
        top.addWidget(self.only_layer)
        table_box = QWidget()
        table_layout = QVBoxLayout(table_box)
        table_layout.setContentsMargins(0, 0, 0, 0)
        table_layout.addLayout(top)
        table_layout.addWidget(self.table)
        splitter = QSplitter(Qt.Vertical)
        splitter.addWidget(table_box)
        splitter.addWidget(self.graphics)
        self.graphics.setMinimumHeight(112)  # the splitter cannot squeeze the plot to a line (title and axes: 65 px)
        splitter.setChildrenCollapsible(False)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 2)
        splitter.setSizes([220, 160])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(splitter)

    def _show_layer_column(self, only_layer: bool) -> None:
        """One layer's rows say the same layer: its column goes, and the reason gets the width."""
        self.table.setColumnHidden(COLUMNS.index("layer"), only_layer)

    def export_target(self):
        return self.graphics

    def visible_rows(self) -> list[tuple]:
        """The rows the table shows, after filtering, as tuples in COLUMNS order."""
        return [self.model.row(self.proxy.mapToSource(self.proxy.index(r, 0)).row())
                for r in range(self.proxy.rowCount())]

    def _refilter(self) -> None:
        self._key = None
        self.show_state(self._state)

    def show_state(self, state: ViewState) -> None:
        self._state = state
        timeline = state.timeline
        limit = timeline.evictions_until(state.index) if timeline is not None and state.record else 0
        key = (id(timeline), limit, state.index, state.layer)
        if key == self._key:
            return
        if self._key is None or self._key[0] != key[0]:
            self.plot._grown = (None, None)
        self._key = key
        events, rows = (timeline.evictions if timeline is not None else []), limit
        if timeline is not None and self.only_layer.isChecked():  # the layer's own newest MAX_ROWS
            if self._layer_events is None or self._layer_events[0] != (id(timeline), state.layer):
                self._layer_events = ((id(timeline), state.layer), timeline.evictions.of_layer(state.layer))
            events = self._layer_events[1]
            rows = events.until(limit)
        self.model.show(events, rows, self.proxy.accepts)
        if self.proxy.set_filter(self.filter.text(), state.layer if self.only_layer.isChecked() else None):
            self.model.fill(self.proxy.accepts)
        if self.table.verticalScrollBar().value() >= self.table.verticalScrollBar().maximum() - 2:
            self.table.scrollToBottom()
        layer = state.layer if self.only_layer.isChecked() else None
        if timeline is not None:
            steps, layers, positions = timeline.eviction_columns()
            keep = slice(None) if layer is None else layers[:limit] == layer
            self.scatter.setData(*_dashes(steps[:limit][keep], positions[:limit][keep]), connect="pairs")
        else:
            self.scatter.setData([], [])
        theme.grow_range(self.plot, len(timeline) if timeline is not None else 1,
                         timeline.n_positions(state.index) if state.record is not None else 1, x_step=32, y_step=32)
        theme.spare_ticks(self.plot)
        if state.record is not None:
            self.cursor.setValue(state.record.step)
        where = f"layer {layer}" if layer is not None else "all layers"
        theme.set_title(self.plot, theme.muted(f"evicted positions (y) by step (x) · {where}"), size="9pt")

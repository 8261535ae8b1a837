"""Eviction events: a filterable table of every eviction up to the selected step, and a timeline plot of
which positions were evicted when."""

from __future__ import annotations

import functools

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QHeaderView, QLineEdit, QSplitter, QTableView,
                               QVBoxLayout, QWidget)

from .. import theme
from . import ViewState

COLUMNS = ("step", "layer", "page", "slot", "position", "token", "reason", "score")
HEADERS = ("step", "layer", "page", "slot", "pos", "token", "reason", "score")


_DISPLAY, _ALIGN = Qt.DisplayRole, Qt.TextAlignmentRole
_RIGHT = int(Qt.AlignRight | Qt.AlignVCenter)


@functools.lru_cache(maxsize=4096)
def _cells(event) -> tuple[str, ...]:
    """The displayed text of one eviction's row (formatted once; repaints only look it up)."""
    return (str(event.step), str(event.layer), str(event.page), str(event.slot), str(event.position),
            repr(event.token)[1:-1], event.reason, "" if np.isnan(event.score) else f"{event.score:.4g}")


class EventTableModel(QAbstractTableModel):
    """Rows are the timeline's evictions 0..limit; growing the limit inserts rows instead of resetting."""

    def __init__(self):
        super().__init__()
        self.events: list = []
        self.limit = 0

    def show(self, events: list, limit: int) -> None:
        if events is self.events and limit >= self.limit:
            if limit > self.limit:
                self.beginInsertRows(QModelIndex(), self.limit, limit - 1)
                self.limit = limit
                self.endInsertRows()
            return
        self.beginResetModel()
        self.events, self.limit = events, limit
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else self.limit

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(COLUMNS)

    def row(self, index: int) -> tuple:
        e = self.events[index]
        return (e.step, e.layer, e.page, e.slot, e.position, e.token, e.reason, e.score)

    def data(self, index, role=Qt.DisplayRole):
        if role == _DISPLAY:
            return _cells(self.events[index.row()])[index.column()]
        if role == _ALIGN:
            return _RIGHT if index.column() not in (5, 6) else None
        if role == Qt.UserRole:  # sort key
            return self.events[index.row()][index.column()]
        return None

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if role == Qt.DisplayRole and orientation == Qt.Horizontal:
            return HEADERS[section]
        if role == Qt.ToolTipRole and orientation == Qt.Horizontal:
            return f"filter with {COLUMNS[section]}=value" if section < 5 else None
        return None


class EventFilter(QSortFilterProxyModel):
    """Text filter over token and reason (or `field=value`, e.g. `layer=3`, `page=2`), and a layer filter."""

    def __init__(self):
        super().__init__()
        self.text = ""
        self.layer: int | None = None
        self.setSortRole(Qt.UserRole)

    def set_filter(self, text: str, layer: int | None) -> None:
        if (text, layer) != (self.text, self.layer):
            if hasattr(self, "beginFilterChange"):  # Qt >= 6.10
                self.beginFilterChange()
                self.text, self.layer = text.strip(), layer
                self.endFilterChange()
            else:
                self.text, self.layer = text.strip(), layer
                self.invalidateFilter()

    def filterAcceptsRow(self, row: int, parent) -> bool:
        event = self.sourceModel().events[row]
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


class EventsView(QWidget):
    title = "Eviction events"
    live_interval = 0.25  # while decoding, refresh at most 4 times a second (a table is read, not watched)

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
        self.only_layer = QCheckBox("selected layer only")
        self.only_layer.setChecked(True)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(False)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.table.setAlternatingRowColors(True)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Interactive)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.horizontalHeader().setMinimumSectionSize(24)
        for column, width in enumerate((38, 38, 36, 32, 40, 60, 150, 50)):
            self.table.setColumnWidth(column, width)

        self.graphics = pg.GraphicsLayoutWidget()
        self.plot = self.graphics.addPlot()
        theme.style_plot(self.plot, left="evicted position", bottom="step")
        self.plot.setMenuEnabled(False)
        self.scatter = pg.ScatterPlotItem(size=5, pen=None, brush=pg.mkBrush(theme.STATE_COLORS[5]))
        self.plot.addItem(self.scatter)
        self.cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=pg.QtCore.Qt.DashLine))
        self.plot.addItem(self.cursor)

        self.filter.textChanged.connect(lambda *_: self._refilter())
        self.only_layer.toggled.connect(lambda *_: self._refilter())
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
        splitter.setSizes([220, 160])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(splitter)

    def export_target(self):
        return self.graphics

    def visible_rows(self) -> list[tuple]:
        """The rows the table shows, after filtering, as tuples in COLUMNS order."""
        return [self.model.row(self.proxy.mapToSource(self.proxy.index(r, 0)).row())
                for r in range(self.proxy.rowCount())]

    def _refilter(self) -> None:
        self.proxy.set_filter(self.filter.text(), self._state.layer if self.only_layer.isChecked() else None)
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
        self.proxy.set_filter(self.filter.text(), state.layer if self.only_layer.isChecked() else None)
        events = timeline.evictions if timeline is not None else []
        self.model.show(events, limit)
        if self.table.verticalScrollBar().value() >= self.table.verticalScrollBar().maximum() - 2:
            self.table.scrollToBottom()
        layer = state.layer if self.only_layer.isChecked() else None
        shown = [e for e in events[:limit] if layer is None or e.layer == layer]
        steps = np.fromiter((e.step for e in shown), dtype=np.float64, count=len(shown))
        positions = np.fromiter((e.position for e in shown), dtype=np.float64, count=len(shown))
        self.scatter.setData(steps, positions)
        theme.grow_range(self.plot, len(timeline) if timeline is not None else 1,
                         timeline.n_positions(state.index) if state.record is not None else 1, x_step=32, y_step=32)
        if state.record is not None:
            self.cursor.setValue(state.record.step)
        where = f"layer {layer}" if layer is not None else "all layers"
        theme.set_title(self.plot, theme.muted(f"evicted positions by step · {where}"), size="9pt")

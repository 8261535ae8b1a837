"""Each request's life as a bar over server time: queued → prefill → decode → done, with any preemption
(back in the queue until it recomputes). One row per request, the newest at the bottom; the rows are the
RequestRows a side's snapshot holds (built from the engine's records)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPainter

from pagevis.gui.widgets import theme

PHASE_COLORS = {"queued": "#5b6270", "prefill": "#ffb020", "decode": theme.SERIES[0], "preempted": "#ef4b4b"}
ROWS_SHOWN = 40


class _Bars(pg.GraphicsObject):
    """Rectangles in view coordinates, one fill per phase, drawn with a few drawRects calls."""

    def __init__(self):
        super().__init__()
        self._rects: dict[str, list[QRectF]] = {}
        self._bounds = QRectF()

    def set_rects(self, rects: dict[str, list[QRectF]], bounds: QRectF) -> None:
        self.prepareGeometryChange()
        self._rects, self._bounds = rects, bounds
        self.update()

    def boundingRect(self) -> QRectF:
        return self._bounds

    def paint(self, painter: QPainter, *args) -> None:
        painter.setPen(Qt.NoPen)
        for phase, rects in self._rects.items():
            painter.setBrush(QBrush(QColor(PHASE_COLORS[phase])))
            painter.drawRects(rects)


class RequestTimeline(pg.PlotWidget):
    def __init__(self):
        super().__init__()
        self.plot = self.getPlotItem()
        theme.style_plot(self.plot, left="request", bottom="server time (s)")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.invertY(True)
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).enableAutoSIPrefix(False)
        self.bars = _Bars()
        self.plot.addItem(self.bars)
        self.done_marks = pg.ScatterPlotItem(size=5, symbol="|", pen=pg.mkPen(theme.TEXT), brush=None)
        self.plot.addItem(self.done_marks)
        self.rows: tuple = ()
        swatches = " ".join(f"<span style='color:{c}'>■</span> {p}" for p, c in PHASE_COLORS.items())
        theme.set_title(self.plot, f"{swatches} │ done", justify="left")  # the tab says what it is
        self.setMinimumHeight(120)

    def show_state(self, snapshot) -> None:
        """The newest ROWS_SHOWN requests of a side's SideSnapshot, up to its server clock."""
        now = snapshot.step.t1 if snapshot.step is not None else 0.0
        self.rows = rows = tuple(snapshot.requests)[-ROWS_SHOWN:]
        rects: dict[str, list[QRectF]] = {p: [] for p in PHASE_COLORS}
        done_x, done_y = [], []
        for y, row in enumerate(rows):
            for phase, t0, t1 in row.segments:
                if phase == "done":
                    done_x.append(t0)
                    done_y.append(y + 0.5)
                elif t1 > t0:
                    rects[phase].append(QRectF(t0, y + 0.15, t1 - t0, 0.7))
        start = min((row.arrival for row in rows), default=0.0)
        self.bars.set_rects(rects, QRectF(start, 0, max(now - start, 1e-3), max(len(rows), 1)))
        self.done_marks.setData(done_x, done_y)
        self.plot.setYRange(0, max(len(rows), 8), padding=0)
        x_range = (np.floor(start / 10) * 10, np.ceil(max(now, start + 1.0) / 10) * 10)
        if x_range != getattr(self, "_x_range", None):  # in steps of 10 s: a new range re-lays the axis out
            self._x_range = x_range
            self.plot.setXRange(*x_range, padding=0.01)
        ticks = [(y + 0.5, str(row.id)) for y, row in enumerate(rows)]
        step = max(1, int(np.ceil(len(ticks) / 12)))
        ticks = [ticks[::step]]
        if ticks != getattr(self, "_ticks", None):
            self._ticks = ticks
            self.plot.getAxis("left").setTicks(ticks)

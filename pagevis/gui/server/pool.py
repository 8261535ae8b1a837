"""One side of the Server window: the pool coloured by request with ref counts, the queues, and each step's
batch (prefill tokens against decode tokens). Everything is read from one ServerStep (its BatchRecord, layer 0).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from pagevis.gui.widgets import theme
from pagevis.gui.sequences.view import CACHED_COLOR, FREE_COLOR, SHARED_COLOR, PageCell, page_cells

PREFILL_COLOR = "#ffb020"
DECODE_COLOR = theme.SERIES[0]
BARS_SHOWN = 120  # steps the batch plot shows


def request_color(request_id: int) -> str:
    """A colour per request, hues spread by the golden ratio so neighbours differ (amber is kept for shared)."""
    hue = (0.55 + request_id * 0.618034) % 1.0
    if 0.08 < hue < 0.14:  # too close to the shared pages' amber
        hue += 0.08
    return QColor.fromHsvF(hue, 0.55, 0.92).name()


def pool_cells(step) -> list[PageCell]:
    """The pool's pages after the step (layer 0), owners given as request ids."""
    record = step.pool
    tables = {step.owners[seq]: table for seq, table in record.block_tables.items()}
    return page_cells(SimpleNamespace(block_tables=tables, ref_counts=record.ref_counts, fill=record.fill,
                                      cached_free=record.cached_free))


class RequestPoolGrid(QWidget):
    """Every page of the pool as a square: a request's own page in its colour with its id, a shared page in
    amber with its ref count, a free page still holding a cached prefix in slate, an empty one dark."""

    def __init__(self):
        super().__init__()
        self.cells: list[PageCell] = []
        self.setMinimumSize(QSize(240, 120))
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Expanding)

    def set_cells(self, cells: list[PageCell]) -> None:
        self.cells = cells
        self.update()

    def _columns(self) -> int:
        n = max(len(self.cells), 1)
        aspect = max(self.width() - 4, 1) / max(self.height() - 4, 1)
        return max(1, min(n, int(np.ceil(np.sqrt(n * aspect)))))

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(theme.BACKGROUND))
        if not self.cells:
            painter.setPen(QColor(theme.MUTED))
            painter.drawText(self.rect(), Qt.AlignCenter, "the pool appears with the first step")
            painter.end()
            return
        columns = self._columns()
        rows = -(-len(self.cells) // columns)
        side = max(2.0, min((self.width() - 4) / columns, (self.height() - 4) / rows))
        gap = 1.0 if side >= 6 else 0.0
        font = painter.font()
        font.setPointSizeF(max(5.0, side / 3.0))
        painter.setFont(font)
        dark = QColor("#0b0c0f")
        for cell in self.cells:
            row, col = divmod(cell.page, columns)
            rect = QRectF(2 + col * side, 2 + row * side, side - gap, side - gap)
            if cell.state == "shared":
                color = QColor(SHARED_COLOR)
            elif cell.state == "private":
                color = QColor(request_color(cell.owners[0]))
            else:
                color = QColor(CACHED_COLOR if cell.state == "cached" else FREE_COLOR)
            painter.fillRect(rect, color)
            if side >= 15 and cell.state in ("private", "shared"):
                painter.setPen(dark)
                painter.drawText(rect, Qt.AlignCenter, f"×{cell.ref_count}" if cell.state == "shared"
                                 else str(cell.owners[0]))
        painter.end()


def legend_html() -> str:
    swatch = "<span style='color:{}'>■</span>"
    return (f"{swatch.format(request_color(0))}{swatch.format(request_color(1))}{swatch.format(request_color(2))}"
            f" a request's own page (its id) &nbsp; {swatch.format(SHARED_COLOR)} shared (×ref count) &nbsp; "
            f"{swatch.format(CACHED_COLOR)} free, still cached &nbsp; {swatch.format(FREE_COLOR)} empty")


class QueuesView(QLabel):
    """The waiting, running and preempted requests after the step, in queue order, in their colours."""

    MAX_SHOWN = 12  # ids a queue's line shows: one line each in a side's panel at 1280 × 720

    def __init__(self):
        super().__init__()
        self.setWordWrap(True)
        self.setTextFormat(Qt.RichText)
        self.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.ids: dict[str, tuple[int, ...]] = {"running": (), "waiting": (), "preempted": ()}
        self.setText(theme.muted("queues appear with the first step"))
        self.setFixedHeight(self.fontMetrics().lineSpacing() * 4 + 6)  # new text never re-lays the panel out

    def set_step(self, step) -> None:
        preempted = set(step.preempted)
        self.ids = {"running": step.running, "waiting": tuple(r for r in step.waiting if r not in preempted),
                    "preempted": step.preempted}
        lines = [f"step {step.step}: " + (f"{step.prefill_tokens} prompt + {step.decode_tokens} decode tokens, "
                                          f"{step.tokens_out} sampled" if step.record is not None else "idle")]
        for name, ids in self.ids.items():
            chips = " ".join(f"<span style='color:{request_color(r)}'>{r}</span>" for r in ids[: self.MAX_SHOWN])
            more = f" … +{len(ids) - self.MAX_SHOWN}" if len(ids) > self.MAX_SHOWN else ""
            lines.append(f"<b>{name}</b> {len(ids)}: {chips}{more}")
        self.setText("<br>".join(lines))


class BatchBars(pg.PlotWidget):
    """Each step's batch: prompt (prefill / recompute) tokens stacked on decode tokens, the newest steps."""

    def __init__(self):
        super().__init__()
        self.plot = self.getPlotItem()
        theme.style_plot(self.plot, bottom="step")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.setMouseEnabled(False, False)
        self.decode = pg.BarGraphItem(x=[], height=[], width=0.8, brush=DECODE_COLOR, pen=None)
        self.prefill = pg.BarGraphItem(x=[], y0=[], height=[], width=0.8, brush=PREFILL_COLOR, pen=None)
        self.plot.addItem(self.decode)
        self.plot.addItem(self.prefill)
        theme.set_title(self.plot, f"<span style='color:{PREFILL_COLOR}'>prompt (prefill)</span> and "
                                   f"<span style='color:{DECODE_COLOR}'>decode</span> tokens of each step")
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).enableAutoSIPrefix(False)
        self.steps = np.zeros(0, np.int64)
        self.prefill_tokens = np.zeros(0, np.int64)
        self.decode_tokens = np.zeros(0, np.int64)
        self.setMinimumHeight(115)  # its title and axis take 75 px: the bars keep 40
        self.plot.setYRange(0, 1, padding=0.02)  # before the first batch, the same two ticks as after
        self.plot.getAxis("left").setTicks([[(0, "0"), (1, "1")]])

    def set_data(self, steps: np.ndarray, prefill: np.ndarray, decode: np.ndarray) -> None:
        """The newest BARS_SHOWN engine steps (idle steps have no batch and are left out by the caller)."""
        self.steps, self.prefill_tokens, self.decode_tokens = steps, prefill, decode
        self.decode.setOpts(x=steps, height=decode, width=0.8)
        self.prefill.setOpts(x=steps, y0=decode, height=prefill, width=0.8)
        if len(steps):
            self.plot.setXRange(float(steps[0]) - 0.5, float(steps[0]) + BARS_SHOWN - 0.5, padding=0)
            top = theme.nice_ceiling(float((prefill + decode).max()))
            if top != getattr(self, "_top", None):  # two ticks: a short plot has room for no more
                self._top = top
                self.plot.setYRange(0, top, padding=0.02)
                self.plot.getAxis("left").setTicks([[(0, "0"), (top, f"{top:g}")]])


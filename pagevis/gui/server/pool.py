"""One side of the Server window: the pool coloured by request with ref counts (the shared PoolGrid), the
queues, and each step's batch (prefill tokens against decode tokens). The pool and queues are read from one
ServerStep (its BatchRecord, layer 0), the batches from the side's SideSeries.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.pool_grid import CACHED_COLOR, FREE_COLOR, SHARED_COLOR, PageCell, PoolGrid, page_cells

PREFILL_COLOR = "#ffb020"
DECODE_COLOR = theme.SERIES[0]
BARS_SHOWN = 120  # steps the batch plot shows


def request_color(request_id: int) -> str:
    """A colour per request, hues spread by the golden ratio so neighbours differ (amber is kept for shared)."""
    hue = (0.55 + request_id * 0.618034) % 1.0
    if 0.08 < hue < 0.14:  # too close to the shared pages' amber
        hue += 0.08
    return QColor.fromHsvF(hue, 0.55, 0.92).name()


def pool_cells(step) -> tuple[PageCell, ...]:
    """The pool's pages after the step (layer 0), owners given as request ids."""
    return page_cells(step.pool, step.owners)


def request_pool_grid() -> PoolGrid:
    """The pool grid of one side: a colour per request, as many columns as fill the panel."""
    return PoolGrid(request_color, empty_text="the pool appears with the first step")


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

    def show_state(self, step) -> None:
        """The queues after one ServerStep."""
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

    def show_state(self, series) -> None:
        """The newest BARS_SHOWN engine steps of a side's SideSeries (idle steps have no batch: left out); its
        columns as read now are snapshots (they only grow, past the end of what was read)."""
        engine = series["engine"] > 0
        steps, prefill, decode = (series[name][engine][-BARS_SHOWN:] for name in ("step", "prefill", "decode"))
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


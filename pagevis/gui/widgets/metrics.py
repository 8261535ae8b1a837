"""Metrics over the session: cache occupancy, evictions per step, per-token latency and, with the oracle
on, how far the bounded cache drifts from a full one (KL, top-1 agreement, attention mass lost)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.cells import STATE_COLORS
from pagevis.viewmodel.view_state import EMPTY_HINT, ViewState


def _curve(plot: pg.PlotItem, color: str, name: str) -> pg.PlotCurveItem:
    """A bare PlotCurveItem: its setData is a fraction of a PlotDataItem's (no clipping, downsampling
    or symbol machinery), and a few thousand points draw as one polyline in C++."""
    item = pg.PlotCurveItem(pen=pg.mkPen(color, width=1.6), name=name)
    theme.cache_item(item)
    plot.addItem(item)
    return item


def rolling_mean(values: np.ndarray, window: int = 8) -> np.ndarray:
    if values.size == 0:
        return values
    finite = np.nan_to_num(values)
    counts = np.cumsum(np.isfinite(values))
    sums = np.cumsum(finite)
    lo = np.arange(values.size) - window
    prev_sums = np.where(lo >= 0, sums[np.maximum(lo, 0)], 0.0)
    prev_counts = np.where(lo >= 0, counts[np.maximum(lo, 0)], 0)
    n = counts - prev_counts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums - prev_sums) / n, np.nan)


MAX_DRAWN = 2000  # points (or bars) a plot draws: more than its pixels, and a long session stays cheap
HEADROOM = 1.1  # the occupancy plot's y range over the capacity


def strided(x: np.ndarray, y: np.ndarray, limit: int = MAX_DRAWN) -> tuple[np.ndarray, np.ndarray]:
    """Every k-th point, so that at most `limit` are drawn (all of them up to `limit`)."""
    k = -(-len(x) // limit)
    return (x, y) if k <= 1 else (x[::k], y[::k])


def binned_max(x: np.ndarray, y: np.ndarray, limit: int = MAX_DRAWN) -> tuple[np.ndarray, np.ndarray, float]:
    """Bars: one per step up to `limit` steps, else one per bin of k steps with the bin's highest value (an
    eviction burst stays visible); returns (x, height, bar width)."""
    k = -(-len(x) // limit)
    if k <= 1:
        return x, y, 0.6
    n = len(x) // k * k
    heights = np.concatenate([y[:n].reshape(-1, k).max(axis=1), [y[n:].max()] if n < len(y) else []])
    return x[::k][: len(heights)] + (k - 1) / 2, heights, 0.6 * k


class MetricsView(QWidget):
    title = "Metrics"
    live_interval = 1.0  # while decoding, at most once a second (trends are read, not watched)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.data: dict[str, np.ndarray] = {}  # what the curves hold, by name
        self._key = None
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.ci.setSpacing(6)
        g = self.graphics
        self.occupancy = g.addPlot(row=0, col=0)
        self.evictions = g.addPlot(row=0, col=1)
        self.latency = g.addPlot(row=1, col=0)
        self.oracle = g.addPlot(row=1, col=1)
        self.tiers = g.addPlot(row=2, col=0, colspan=2)  # only with a disk tier
        theme.style_plot(self.tiers)
        self.tiers.setMenuEnabled(False)
        self.tiers.getAxis("left").setWidth(38)
        self.tiers.setXLink(self.occupancy)
        self.tiers.hide()
        for plot in (self.occupancy, self.evictions, self.latency, self.oracle):
            theme.style_plot(plot)
            plot.setMenuEnabled(False)
            plot.getAxis("left").setWidth(38)
        for plot in (self.evictions, self.latency, self.oracle):
            plot.setXLink(self.occupancy)
        s = theme.SERIES
        self.curves = {
            "resident_tokens": _curve(self.occupancy, s[0], "resident tokens"),
            "allocated_slots": _curve(self.occupancy, s[1], "slots in used pages"),
            "latency_ms": _curve(self.latency, s[0], "ms / token"),
            "latency_avg": _curve(self.latency, s[1], "mean of 8"),
            "kl": _curve(self.oracle, s[1], "KL (nats)"),
            "lost_attention": _curve(self.oracle, s[3], "attention lost"),
            "top1_agree": _curve(self.oracle, s[2], "top-1 agree (mean of 8)"),
            "faults": _curve(self.tiers, s[3], "pages read from disk / step (all layers)"),
            "mb_read": _curve(self.tiers, s[0], "MB read / step"),
            "hit_rate": _curve(self.tiers, s[2], "RAM hit rate"),
        }
        # one bar per step with gaps between them (a filled step curve read as a solid block at 1 per step)
        self.bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.6, pen=None,
                                    brush=pg.mkBrush(STATE_COLORS[5]), name="evicted")
        theme.cache_item(self.bars)
        self.evictions.addItem(self.bars)
        # named in the plot's title, not by a label on the line: the resident curve runs along it once full
        self.capacity = pg.InfiniteLine(angle=0, pen=pg.mkPen(theme.MUTED, style=Qt.DotLine))
        self.occupancy.addItem(self.capacity)
        self.occupancy.setToolTip("resident tokens and slots in used pages of the selected layer; the dotted line "
                                  "(cap) is the cache's capacity in tokens")
        self.cursors = []
        for plot in (self.occupancy, self.evictions, self.latency, self.oracle):
            line = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=Qt.DashLine))
            plot.addItem(line, ignoreBounds=True)
            self.cursors.append(line)
        # three short lines: at 85% of a laptop screen this plot is about 100 px wide
        self.oracle_off = pg.TextItem("oracle off\n(Decoding)", color=theme.MUTED, anchor=(0.5, 0.5))
        self._titles()
        self.oracle.addItem(self.oracle_off, ignoreBounds=True)
        self.hint = pg.TextItem(EMPTY_HINT, color=theme.MUTED, anchor=(0.5, 0.5))
        self.occupancy.addItem(self.hint, ignoreBounds=True)
        self.setMinimumSize(260, 220)  # four plots with their axes and one-line titles
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.graphics)

    def export_target(self):
        return self.graphics

    def _titles(self, layer: int = 0) -> None:
        def key(color: str, text: str) -> str:
            return f"<span style='color:{color}'>━ {text}</span>"

        def title(plot: pg.PlotItem, heading: str, *keys: str) -> None:
            theme.set_title(plot, f"<span style='color:{theme.TEXT}'>{heading}</span>&nbsp; " + "&nbsp; ".join(keys),
                            justify="left")

        s = theme.SERIES
        title(self.occupancy, key(s[0], "resident"), key(s[1], "allocated"),  # of the layer the next plot names
              f"<span style='color:{theme.MUTED}'>┈ cap</span>")
        title(self.evictions, f"evicted / step · layer {layer}")
        title(self.latency, "ms / token", key(s[0], "each"), key(s[1], "mean of 8"))
        title(self.oracle, "oracle", key(s[1], "KL"), key(s[3], "lost attn"), key(s[2], "top-1"))
        title(self.tiers, "disk tier, all layers", key(s[3], "faults / step ÷ 100"), key(s[0], "MB read / step"),
              key(s[2], "RAM hit rate"))

    def show_state(self, state: ViewState) -> None:
        timeline = state.timeline
        count = len(timeline) if timeline is not None else 0
        key = (id(timeline), count, state.layer, state.loading)
        if key != self._key:
            self._key = key
            self._update_curves(state)
        if state.record is not None:
            for line in self.cursors:
                line.setValue(state.index)

    def _update_curves(self, state: ViewState) -> None:
        timeline = state.timeline
        if timeline is not getattr(self, "_timeline", None):
            self._timeline = timeline
            for plot in (self.occupancy, self.evictions, self.latency, self.oracle, self.tiers):
                plot._grown = (None, None)  # a new session: fit the views afresh
        self.hint.setVisible(timeline is None or not len(timeline))
        for line in self.cursors:
            line.setVisible(timeline is not None and len(timeline) > 0)
        if timeline is None or not len(timeline):
            self._show_empty(state)
            return
        steps = np.arange(len(timeline), dtype=np.float64)
        config = timeline.info.config
        pages = timeline.pages_per_step(state.layer)
        latency = timeline.series("latency_ms") / np.maximum(timeline.series("tokens"), 1)
        data = {
            "resident_tokens": timeline.resident_per_step(state.layer),
            "allocated_slots": pages * config.page_size,
            "evictions": timeline.evictions_per_step(state.layer).astype(np.float64),
            "latency_ms": latency,
            "latency_avg": rolling_mean(latency),
            "kl": timeline.series("kl"),
            "lost_attention": timeline.series("lost_attention"),
            "top1_agree": rolling_mean(timeline.series("top1_agree")),
            "faults": timeline.series("faults") / 100,  # on the MB and hit-rate scale
            "mb_read": timeline.series("mb_read"),
            "hit_rate": timeline.series("hit_rate"),
        }
        tiered = bool(np.isfinite(data["hit_rate"]).any())
        self.tiers.setVisible(tiered)
        self.data = data
        for name, values in data.items():
            if name == "evictions":
                self.bars.setOpts(**dict(zip(("x", "height", "width"), binned_max(steps, values))))
            else:
                self.curves[name].setData(*strided(steps, values), connect="finite")
        capacity = config.capacity
        if self.capacity.value() != capacity:  # its label re-renders on every setValue
            self.capacity.setValue(capacity)
        self.capacity.setVisible(True)
        n = len(timeline)

        def top(values: np.ndarray) -> float:
            finite = values[np.isfinite(values)]
            return float(finite.max()) if finite.size else 1.0

        theme.grow_range(self.occupancy, n, capacity * HEADROOM, x_step=32, y_step=capacity * HEADROOM)
        # headroom above the tallest bar, so that one eviction every step reads as bars, not a wall
        theme.grow_range(self.evictions, None, max(top(data["evictions"]), 1.0) * 1.25)
        theme.grow_range(self.latency, None, top(latency))
        theme.grow_range(self.oracle, None, max(top(data["kl"]), 1.0))
        if tiered:
            theme.grow_range(self.tiers, None, max(top(data["faults"]), top(data["mb_read"]), 1.0))
        self._titles(state.layer)
        self._show_oracle_state(config)

    def _show_empty(self, state: ViewState) -> None:
        """Before the first step: empty curves on the axes the first 32 steps will use (occupancy up to
        the cache's capacity, the others from 0 to 1), and what to do next."""
        self.data = {}
        for curve in self.curves.values():
            curve.setData([], [])
        self.bars.setOpts(x=np.zeros(0), height=np.zeros(0))
        config = state.config
        capacity = config.capacity if config is not None else 1  # what the first step's line will be (a disk tier's)
        if config is not None and self.capacity.value() != capacity:
            self.capacity.setValue(capacity)
        self.capacity.setVisible(config is not None)
        theme.grow_range(self.occupancy, 32, capacity * HEADROOM, x_step=32, y_step=capacity * HEADROOM)
        for plot in (self.evictions, self.latency, self.oracle):
            theme.grow_range(plot, None, 1.0)
        self.hint.setPos(16, capacity * 0.5)
        if state.timeline is None:
            self.hint.setText("loading\nthe model…" if config is not None else "no session")
        else:
            self.hint.setText(EMPTY_HINT.replace(" to ", "\nto "))  # two short lines: the plot is narrow
        self._titles(state.layer)
        if config is not None:
            self._show_oracle_state(config)

    def _show_oracle_state(self, config) -> None:
        oracle_on = bool(config.oracle)
        self.oracle_off.setVisible(not oracle_on)
        if not oracle_on:
            self.oracle_off.setPos(self.occupancy._grown[0] / 2, 0.5)

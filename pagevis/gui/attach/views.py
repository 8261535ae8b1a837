"""The attach window's views, each drawing a snapshot the window's workers published (`show_state`):
`ForestPanel` the prefix forest of a ForestFrame (with the button back to the whole forest and the selected
block's details, which the window fills), `EnginePlots` one engine's EngineState (rates, resident blocks, media, lifetimes, hot prefixes) with
`MetricPlots` under them (the --metrics series), `HotTable` the hot-prefix rows, `EnginesTable` the fleet and
the blocks its engines hold in common. Ranges change in coarse steps (a range that moves every frame re-lays
its axes out), titles never (the numbers go to the line under the plots).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QHeaderView, QLabel, QPlainTextEdit, QPushButton, QSplitter, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import stacked
from pagevis.gui.widgets.prefix_forest import PrefixForestView
from pagevis.viewmodel.attach_forest import lifetime_histogram, medium_color, rates, short_hash

STORED_COLOR, REMOVED_COLOR = "#3ddc84", "#ef4b4b"
HOT_HEADERS = ["block", "medium", "restores", "last gap", "resident", "text"]
ENGINE_HEADERS = ["engine", "batches", "last seq", "epoch", "resident", "held elsewhere", "decode errors",
                  "gaps lost"]


def _item(text: str, align_right: bool = False) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setFlags(item.flags() & ~Qt.ItemIsEditable)
    if align_right:
        item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
    return item


def _fill_table(table: QTableWidget, headers: list[str], rows: list[list[str]], right: set[int] = frozenset()):
    if [table.horizontalHeaderItem(i).text() if table.horizontalHeaderItem(i) else None
            for i in range(table.columnCount())] != headers:
        table.setColumnCount(len(headers))
        table.setHorizontalHeaderLabels(headers)
    table.setRowCount(len(rows))
    for r, row in enumerate(rows):
        for c, text in enumerate(row):
            current = table.item(r, c)
            if current is None or current.text() != text:
                table.setItem(r, c, _item(text, c in right))


def _setup_table(table: QTableWidget, headers: list[str]) -> None:
    table.setColumnCount(len(headers))
    table.setHorizontalHeaderLabels(headers)
    table.verticalHeader().setVisible(False)
    table.setSelectionMode(QTableWidget.NoSelection)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
    table.horizontalHeader().setStretchLastSection(True)


def _plot(graphics: pg.GraphicsLayoutWidget, row: int, col: int, left: str = "", bottom: str = "",
          colspan: int = 1) -> pg.PlotItem:
    plot = graphics.addPlot(row=row, col=col, colspan=colspan)
    theme.style_plot(plot, left=left, bottom=bottom)
    plot.setMenuEnabled(False)
    plot.getAxis("left").setWidth(60)
    return plot


def _curve(plot: pg.PlotItem, color: str, name: str, width: float = 1.6) -> pg.PlotDataItem:
    item = pg.PlotDataItem(pen=pg.mkPen(color, width=width), name=name, clipToView=True, autoDownsample=True,
                           symbolBrush=color, symbolPen=None, symbolSize=5)
    plot.addItem(item)
    return item


def _set_curve(item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray) -> None:
    """Points get symbols while there are few of them (a lone point is otherwise invisible)."""
    item.setSymbol("o" if len(x) <= 60 else None)
    item.setData(x, y)


def _alpha(color: str, alpha: int) -> QColor:
    c = QColor(color)
    c.setAlpha(alpha)
    return c


def _fit(plot: pg.PlotItem, x: float | None, y: float | None, negative_x: bool = True) -> None:
    """Show x from -x to 0 (or 0 to x) and y from 0 to y, in 1-2-2.5-5 steps, changed only when the data
    outgrows the range or falls under a quarter of it."""

    def fit(value, current):
        if value is None:
            return current
        value = max(value, 1e-9)
        if current is not None and current / 4 < value <= current:
            return current
        return theme.level_ceiling(value)

    current = getattr(plot, "_fitted", (None, None))
    fitted = (fit(x, current[0]), fit(y, current[1]))
    if fitted == current:
        return
    plot._fitted = fitted
    plot.disableAutoRange()
    if fitted[0] is not None:
        plot.setXRange(-fitted[0] if negative_x else 0, 0 if negative_x else fitted[0], padding=0.02)
    if fitted[1] is not None:
        plot.setYRange(0, fitted[1], padding=0.04)


def _seconds(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    if abs(value) < 120:
        return f"{value:.3g} s"
    return f"{value / 60:.1f} min"


class ForestPanel(QSplitter):
    """The forest above the selected block's details."""

    def __init__(self, budget: int):
        super().__init__(Qt.Vertical)
        self.forest = PrefixForestView(budget=budget)
        self.forest.set_empty_text("waiting for the first blocks…")
        self.show_all = QPushButton("Show the whole forest")
        self.show_all.setToolTip("the forest shows one block's subtree (double-click a block or a collapsed "
                                 "subtree to choose it)")
        self.show_all.hide()
        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setPlaceholderText("hover a block for its hash, parent, tokens and medium; click it to see "
                                        "its whole prefix here")
        self.addWidget(stacked((self.forest, 1), self.show_all))
        self.addWidget(self.details)
        self.setStretchFactor(0, 5)
        self.setStretchFactor(1, 1)
        self.setSizes([760, 170])

    def show_state(self, frame) -> None:
        """A ForestFrame: its drawing, what it is as of, and (a focused one) which subtree it shows."""
        c = frame.forest.engine.counters
        note = theme.muted(f"as of seq {c.last_seq if c.last_seq is not None else '-'}"
                           + (f", message {frame.position:,}" if frame.position is not None else "")
                           + f" · built in {1000 * frame.build_s:,.0f} ms")
        if frame.focus is not None:
            whole = int(frame.forest.rows.blocks().sum())
            note = (f"<b>subtree of block {short_hash(frame.focus[2])}</b> (of {whole:,} blocks; "
                    f"double-click another block or show the whole forest) · " + note)
        self.show_all.setVisible(frame.focus is not None)
        self.forest.set_drawing(frame.drawing, note)
        if not len(frame.forest.rows):
            self.forest.set_empty_text("no resident blocks")


class EnginePlots(QWidget):
    """One engine's plots over its own clock, and the line of numbers under them; with --metrics, the
    requests and cache plots of `metrics` (MetricPlots) in the same layout."""

    def __init__(self, with_metrics: bool):
        super().__init__()
        g = self.graphics = pg.GraphicsLayoutWidget()
        g.ci.setSpacing(8)
        self.rates_plot = _plot(g, 0, 0, "blocks / s", "s before the last batch (engine clock)", colspan=2)
        self.stored_curve = _curve(self.rates_plot, STORED_COLOR, "stored")
        self.removed_curve = _curve(self.rates_plot, REMOVED_COLOR, "removed")
        self.resident_plot = _plot(g, 1, 0, "blocks", "s before the last batch")
        self.resident_curve = _curve(self.resident_plot, theme.ACCENT, "resident")
        self.media_plot = _plot(g, 1, 1, "", "blocks")
        self.media_plot.getAxis("left").setWidth(74)
        self.media_bars = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[], pen=None)
        self.media_plot.addItem(self.media_bars)
        self.media_plot.invertY(True)
        self.lifetime_plot = _plot(g, 2, 0, "blocks", "lifetime: stored → removed (log scale)")
        self.lifetime_plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.lifetime_curve = pg.PlotDataItem(stepMode="center", fillLevel=0, pen=pg.mkPen(theme.SERIES[4], width=1.4),
                                              brush=pg.mkBrush(_alpha(theme.SERIES[4], 90)))
        self.lifetime_plot.addItem(self.lifetime_curve)
        self.hot_plot = _plot(g, 2, 1, "restores", "s since the removal")
        self.hot_points = pg.ScatterPlotItem(size=7, pen=None, brush=pg.mkBrush(theme.SERIES[1]))
        self.hot_plot.addItem(self.hot_points)
        self.empty_notes = {}
        for plot, text in ((self.lifetime_plot, "no block removed yet"),
                           (self.hot_plot, "no block stored again soon after its removal"),
                           (self.rates_plot, "no batches yet"), (self.resident_plot, "no batches yet")):
            note = pg.TextItem(text, color=theme.MUTED, anchor=(0.5, 0.5))
            plot.addItem(note, ignoreBounds=True)
            note.setParentItem(plot.vb)  # placed in the view box's own pixels, whatever the range
            self.empty_notes[plot] = note
        self.metrics = MetricPlots(g, 3)
        self.metrics.set_visible(with_metrics)
        self._titles()
        self.stats = QLabel("")
        self.stats.setWordWrap(True)
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(g, 1)
        column.addWidget(self.stats)
        self._media: list[str] = []
        self._media_labels: list = []
        self._lifetime_ticks: list = []

    def _titles(self) -> None:
        theme.set_title(self.rates_plot, f"blocks <span style='color:{STORED_COLOR}'>stored</span> / "
                        f"<span style='color:{REMOVED_COLOR}'>removed</span> per second")
        theme.set_title(self.resident_plot, "resident blocks (all media) after each batch")
        theme.set_title(self.media_plot, "resident blocks per medium, now")
        theme.set_title(self.lifetime_plot, "block lifetimes (the most recent removals)")
        theme.set_title(self.hot_plot, "hot prefixes: restores by gap")

    def show_state(self, engine) -> None:
        """The curves, bars and histogram of one engine's state (a FleetFrame's `engine`)."""
        r = rates(engine.history)
        _set_curve(self.stored_curve, r.x, r.stored)
        _set_curve(self.removed_curve, r.x, r.removed)
        _set_curve(self.resident_curve, r.resident_x, r.resident)
        span = -float(r.resident_x[0]) if len(r.resident_x) else 0.0
        top = max(float(r.stored.max()) if len(r.stored) else 0.0, float(r.removed.max()) if len(r.removed) else 0.0)
        _fit(self.rates_plot, span + r.bin_s, top)
        _fit(self.resident_plot, span, float(r.resident.max()) if len(r.resident) else 0.0)
        stats = [f"rates in {_seconds(r.bin_s)} bins over the last {len(r.resident_x):,} batches"]
        self._show_media(list(engine.resident.items()))
        stats += self._show_lifetimes(engine)
        hot = engine.hot
        self.hot_points.setData([h.last_gap_s for h in hot], [h.restores for h in hot])
        if hot:
            _fit(self.hot_plot, max(h.last_gap_s for h in hot) * 1.1, float(hot[0].restores) * 1.1,
                 negative_x=False)
            stats.append(f"hot: {len(hot):,} block{'s' if len(hot) != 1 else ''} stored again soon after "
                         f"removal (most: {hot[0].restores}×)")
        text = theme.muted(" · ".join(stats))
        if self.stats.text() != text:
            self.stats.setText(text)
        for plot, empty in ((self.lifetime_plot, not engine.lifetimes_total), (self.hot_plot, not hot),
                            (self.rates_plot, not len(r.x)), (self.resident_plot, not len(r.x))):
            note = self.empty_notes[plot]
            note.setVisible(empty)
            if empty:
                note.setPos(plot.vb.boundingRect().center())

    def _show_media(self, media: list) -> None:
        if [m for m, _ in media] != self._media:
            self._media = [m for m, _ in media]
            self.media_plot.getAxis("left").setTicks([[(i, m[:10]) for i, m in enumerate(self._media)]])
            self.media_plot.setYRange(-0.6, max(len(media), 1) - 0.4, padding=0)
            for item in self._media_labels:
                self.media_plot.removeItem(item)
            self._media_labels = [pg.TextItem("", color=theme.TEXT, anchor=(0, 0.5)) for _ in media]
            for item in self._media_labels:
                self.media_plot.addItem(item, ignoreBounds=True)
        counts = np.array([n for _, n in media], dtype=np.float64)
        self.media_bars.setOpts(x0=np.zeros(len(media)), y=np.arange(len(media)), height=0.6, width=counts,
                                brushes=[pg.mkBrush(medium_color(m, i)) for i, (m, _) in enumerate(media)])
        for i, (item, n) in enumerate(zip(self._media_labels, counts)):
            item.setText(f"{int(n):,}")
            item.setPos(float(n), i)
        _fit(self.media_plot, float(counts.max()) * 1.3 if len(counts) else 0.0, None, negative_x=False)

    def _show_lifetimes(self, engine) -> list[str]:
        """The lifetime histogram; its line of numbers (none before the first removal)."""
        edges, hist = lifetime_histogram(engine.lifetimes)
        self.lifetime_curve.setData(edges, hist)
        if len(edges):
            decades = [(e, _seconds(10 ** e)) for e in edges if abs(e - round(e)) < 1e-9]
            ticks = decades if len(decades) >= 3 else [(e, _seconds(10 ** e)) for e in edges[::2]]
            if ticks != self._lifetime_ticks:
                self._lifetime_ticks = ticks
                self.lifetime_plot.getAxis("bottom").setTicks([ticks])
                self.lifetime_plot.setXRange(float(edges[0]), float(edges[-1]), padding=0.06)
            _fit(self.lifetime_plot, None, float(hist.max()))
        if not engine.lifetimes_total:
            return []
        return [f"lifetimes: last {len(engine.lifetimes):,} of {engine.lifetimes_total:,} removed, "
                f"mean {_seconds(engine.lifetimes_mean_s)}"]


class MetricPlots:
    """The --metrics row of the plots: requests running / waiting, KV usage and prefix hit rate."""

    def __init__(self, g: pg.GraphicsLayoutWidget, row: int):
        self.requests_plot = _plot(g, row, 0, "requests", "s since attach")
        self.running_curve = _curve(self.requests_plot, theme.SERIES[0], "running")
        self.waiting_curve = _curve(self.requests_plot, theme.SERIES[1], "waiting")
        self.cache_plot = _plot(g, row, 1, "%", "s since attach")
        self.cache_plot.setXLink(self.requests_plot)
        self.usage_curve = _curve(self.cache_plot, theme.SERIES[2], "KV usage")
        self.hit_curve = _curve(self.cache_plot, theme.SERIES[5], "prefix hit rate")
        self.cache_plot.setYRange(0, 100, padding=0.02)
        theme.set_title(self.requests_plot, f"requests <span style='color:{theme.SERIES[0]}'>running</span> / "
                        f"<span style='color:{theme.SERIES[1]}'>waiting</span> (--metrics)")
        theme.set_title(self.cache_plot, f"<span style='color:{theme.SERIES[2]}'>KV usage</span> / "
                        f"<span style='color:{theme.SERIES[5]}'>prefix hit rate</span> (%, --metrics)")

    def set_visible(self, visible: bool) -> None:
        for plot in (self.requests_plot, self.cache_plot):
            plot.setVisible(visible)

    def show_state(self, series: dict) -> None:
        """attach_forest.metric_series: name -> (x, y)."""
        for name, curve in (("running", self.running_curve), ("waiting", self.waiting_curve),
                            ("kv_usage", self.usage_curve), ("hit_rate", self.hit_curve)):
            _set_curve(curve, *series[name])


class HotTable(QTableWidget):
    """Blocks stored again soon after their removal (attach_forest.hot_rows)."""

    def __init__(self):
        super().__init__()
        _setup_table(self, HOT_HEADERS)

    def show_state(self, rows) -> None:
        _fill_table(self, HOT_HEADERS, [[r.hash, r.medium, str(r.restores), _seconds(r.last_gap_s),
                                         "yes" if r.resident else "no", r.text] for r in rows], right={2, 3})


class Fleet(NamedTuple):
    """What the engines table shows: the FleetFrame, and the newest forest's overlap table (or None)."""

    frame: object
    overlap: object


class EnginesTable(QTableWidget):
    """Each engine's counters and the GPU blocks it holds in common with the others."""

    def __init__(self):
        super().__init__()
        _setup_table(self, ENGINE_HEADERS)

    def show_state(self, fleet: Fleet) -> None:
        frame, table = fleet
        headers = list(ENGINE_HEADERS)
        pairwise = table is not None and table.pairwise is not None and len(table.names) == len(frame.engines)
        if pairwise:
            headers += [f"∩ {i}" for i in range(len(table.names))]
        rows = []
        for i, line in enumerate(frame.engines):
            c = line.counters
            resident = ", ".join(f"{m} {n:,}" for m, n in line.resident.items() if n) or "0"
            held = "-"
            if table is not None and i < len(table.held_elsewhere) and len(table.names) > 1:
                held = f"{table.held_elsewhere[i]:,} of {table.gpu[i]:,}"
            row = [f"{i}: {line.name}", f"{c.batches:,}", str(c.last_seq if c.last_seq is not None else "-"),
                   str(c.epoch), resident, held, f"{c.decode_errors:,}", f"{c.gaps_unrecovered:,}"]
            if pairwise:
                row += [f"{int(v):,}" for v in table.pairwise[i]]
            rows.append(row)
        _fill_table(self, headers, rows, right={1, 2, 3, 6, 7} | set(range(8, len(headers))))

"""The Server window's plots over server time, one series per side: throughput, time to first token,
inter-token latency, KV usage (pages used, and what contiguous reservation would hold) and the prefix-cache
hit rate. `SideSeries` holds the numbers of every ServerStep of a side (no Qt); the plots draw them.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.metrics import strided
from pagevis.viewmodel.server_series import THROUGHPUT_WINDOW, SideSeries

SIDE_COLORS = {"A": theme.SERIES[0], "B": theme.SERIES[1]}


def _curve(plot, color: str, style=None, width: float = 1.6) -> pg.PlotCurveItem:
    pen = pg.mkPen(color, width=width)
    if style is not None:
        pen.setStyle(style)
    item = pg.PlotCurveItem(pen=pen, connect="finite")
    plot.addItem(item)
    return item


class ServerPlots(pg.GraphicsLayoutWidget):
    """Five plots over server time, two a row (one plot a row left each 18 px high at 1280 × 720); each side a
    colour (A blue, B amber)."""

    def __init__(self):
        super().__init__()
        from PySide6.QtCore import Qt

        self.plots = {}
        places = {"throughput": (0, 0, 1), "ttft": (0, 1, 1), "itl": (1, 0, 1), "kv": (1, 1, 1), "hits": (2, 0, 2)}
        for name, left in (("throughput", "tok/s"), ("ttft", "s"), ("itl", "s"), ("kv", "% pool"), ("hits", "%")):
            row, col, span = places[name]
            plot = self.addPlot(row=row, col=col, colspan=span)
            theme.style_plot(plot, left=left, bottom="server time (s)" if name == "hits" else "")
            plot.setMenuEnabled(False)
            plot.hideButtons()
            for axis in ("left", "bottom"):
                plot.getAxis(axis).enableAutoSIPrefix(False)  # a new prefix re-lays the plot out
            self.plots[name] = plot
        for name in ("ttft", "itl", "kv", "hits"):
            self.plots[name].setXLink(self.plots["throughput"])
        full = pg.InfiniteLine(100, angle=0, pen=pg.mkPen(theme.MUTED, width=1, style=Qt.DotLine))
        self.plots["kv"].addItem(full)  # the whole pool: a reservation above it could not have been held
        self.curves: dict[str, dict[str, object]] = {}
        for side, color in SIDE_COLORS.items():
            ttft = pg.ScatterPlotItem(size=5, pen=None, brush=pg.mkBrush(color))
            self.plots["ttft"].addItem(ttft)
            self.curves[side] = {"throughput": _curve(self.plots["throughput"], color), "ttft": ttft,
                                 "itl": _curve(self.plots["itl"], color, width=1.2),
                                 "kv": _curve(self.plots["kv"], color),
                                 "reserved": _curve(self.plots["kv"], color, Qt.DashLine, 1.2),
                                 "hits": _curve(self.plots["hits"], color)}
        self.series: dict[str, SideSeries] = {}
        self.drawn: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}  # side -> plot -> (x, y) as drawn
        self._titles()

    def show_state(self, series: dict[str, SideSeries]) -> None:
        self.series = series
        t_max, tops = 1.0, {"throughput": 0.0, "ttft": 0.0, "itl": 0.0, "kv": 100.0}
        for side, curves in self.curves.items():
            s = series.get(side)
            if s is None or not len(s):
                for item in curves.values():
                    item.setData([], [])
                self.drawn.pop(side, None)
                continue
            t = s["t"]
            pool = np.maximum(s["pool"], 1)
            data = {"throughput": s.throughput(), "ttft": (s.ttft_t.values, s.ttft.values),
                    "itl": (t, s["itl"]), "kv": (t, 100.0 * s["pages_used"] / pool),
                    "reserved": (t, 100.0 * s["reserved"] / pool), "hits": (t, s.hit_rate())}
            self.drawn[side] = data
            for name, (x, y) in data.items():
                curves[name].setData(*strided(x, y))
            t_max = max(t_max, float(t[-1]))
            for name in tops:
                y = np.concatenate([data["kv"][1], data["reserved"][1]]) if name == "kv" else data[name][1]
                if len(y) and np.isfinite(y).any():
                    tops[name] = max(tops[name], float(np.nanmax(y)))
        for name, plot in self.plots.items():
            theme.grow_range(plot, t_max, tops.get(name, 100.0) or 1.0)

    def _titles(self) -> None:
        """Fixed titles (a title whose text changes re-lays its plot out); the numbers are in numbers_html()."""
        for name, title in (("throughput", f"throughput, last {THROUGHPUT_WINDOW:g} s"),
                            ("ttft", "time to first token"),
                            ("itl", "inter-token latency"),
                            ("kv", "KV pages: used ━ reserved ╌"),
                            ("hits", "prefix-cache hit rate so far (share of prompt tokens found cached)")):
            theme.set_title(self.plots[name], title)

    def numbers_html(self) -> str:
        """The newest value of every plot, per side, on one line."""
        def each(fn) -> str:
            return " · ".join(f"<span style='color:{SIDE_COLORS[side]}'>{side} {fn(s)}</span>"
                              for side, s in self.series.items() if len(s))

        def last(values: np.ndarray, fmt: str) -> str:
            finite = values[np.isfinite(values)]
            return fmt.format(finite[-1]) if len(finite) else "–"

        if not any(len(s) for s in self.series.values()):
            return ""
        items = ("throughput " + each(lambda s: last(s.throughput()[1], "{:.1f}/s")),
                 "last TTFT " + each(lambda s: last(s.ttft.values, "{:.2f} s")),
                 "ITL " + each(lambda s: last(s["itl"], "{:.2f} s")),
                 "KV " + each(lambda s: f"{s['pages_used'][-1]:.0f}%" if getattr(s, "percent", False)
                              else f"{s['pages_used'][-1]:.0f} of {s['pool'][-1]:.0f} pages"),
                 "reserved " + each(lambda s: last(s["reserved"], "{:.0f}")),
                 "hit rate " + each(lambda s: last(s.hit_rate(), "{:.0f}%")))
        return "<br>".join(" │ ".join(items[i: i + 2]) for i in range(0, len(items), 2))  # fits a 1280-px window

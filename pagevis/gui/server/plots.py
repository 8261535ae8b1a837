"""The Server window's plots over server time, one series per side: throughput, time to first token,
inter-token latency, KV usage (pages used, and what contiguous reservation would hold) and the prefix-cache
hit rate. `SideSeries` holds the numbers of every ServerStep of a side (no Qt); the plots draw them.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.metrics import strided

SIDE_COLORS = {"A": theme.SERIES[0], "B": theme.SERIES[1]}
THROUGHPUT_WINDOW = 10.0  # server seconds the throughput is averaged over


class _Column:
    """A growing NumPy column (amortised doubling)."""

    def __init__(self, dtype=np.float64):
        self._data = np.zeros(64, dtype)
        self.n = 0

    def append(self, value) -> None:
        if self.n == len(self._data):
            self._data = np.concatenate([self._data, np.zeros_like(self._data)])
        self._data[self.n] = value
        self.n += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[: self.n]


class SideSeries:
    """Every step's numbers of one side, as its ServerSteps gave them."""

    COLUMNS = ("t", "engine", "tokens_out", "generated", "prefill", "decode", "pages_used", "reserved", "pool",
               "hits", "queries", "itl", "completed", "preemptions", "step", "rejected")

    def __init__(self, side: str):
        self.side = side
        self.columns = {name: _Column() for name in self.COLUMNS}
        self.ttft_t, self.ttft = _Column(), _Column()

    def __len__(self) -> int:
        return self.columns["t"].n

    def add(self, step) -> None:
        c = self.columns
        for name, value in (("t", step.t1), ("engine", step.record is not None), ("tokens_out", step.tokens_out),
                            ("generated", step.generated), ("prefill", step.prefill_tokens),
                            ("decode", step.decode_tokens), ("pages_used", step.pages_used),
                            ("reserved", step.reserved_pages), ("pool", step.pool_pages),
                            ("hits", step.prefix_hits), ("queries", step.prefix_queries),
                            ("itl", np.mean(step.itl) if step.itl else np.nan), ("completed", step.completed),
                            ("preemptions", step.preemptions), ("step", step.step),
                            ("rejected", step.rejected)):
            c[name].append(value)
        for value in step.ttft:
            self.ttft_t.append(step.t1)
            self.ttft.append(value)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name].values

    def throughput(self, window: float = THROUGHPUT_WINDOW) -> tuple[np.ndarray, np.ndarray]:
        """Tokens generated per server second over the last `window` seconds, at the end of each step."""
        t, generated = self["t"], self["generated"]
        if not len(t):
            return t, t
        j = np.searchsorted(t, t - window, side="right") - 1  # the last step that ended a window ago
        t_from = np.where(j >= 0, t[np.maximum(j, 0)], 0.0)
        g_from = np.where(j >= 0, generated[np.maximum(j, 0)], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return t, np.where(t > t_from, (generated - g_from) / (t - t_from), 0.0)

    def hit_rate(self) -> np.ndarray:
        """The engine's prefix-cache hit rate so far (hit tokens / looked-up prompt tokens), in %."""
        queries = self["queries"]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(queries > 0, 100.0 * self["hits"] / np.maximum(queries, 1), np.nan)

    def summary(self) -> dict[str, float]:
        """The numbers of the A/B table, over the whole run so far."""
        if not len(self):
            return {}
        t = float(self["t"][-1])
        generated = float(self["generated"][-1])
        return {"time": t, "completed": float(self["completed"][-1]), "generated": generated,
                "throughput": generated / t if t > 0 else 0.0,
                "ttft_mean": float(np.mean(self.ttft.values)) if self.ttft.n else np.nan,
                "itl_mean": float(np.nanmean(self["itl"])) if np.isfinite(self["itl"]).any() else np.nan,
                "peak_pages": float(self["pages_used"].max()), "peak_reserved": float(self["reserved"].max()),
                "pool": float(self["pool"][-1]), "preemptions": float(self["preemptions"][-1]),
                "rejected": float(self["rejected"][-1]),
                "hit_rate": float(self.hit_rate()[-1]) if np.isfinite(self.hit_rate()[-1]) else 0.0}


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

"""The A/B window's two plots, side by side under the grids.

Teacher-forced ("same text"): the running perplexity of A, B and the full cache over the tokens read (log
scale; the window's leaves the full cache's at its first eviction), and each token's NLL (faint) with its
16-token mean. Free-running: KL(A‖B) while both still predict after the same text (after the texts diverge it
only says that they differ, so the curve stops there), then each side's repetition rate — the share of its
newest 64 tokens that repeat a 4-gram it already wrote: a side that loops climbs towards 1. In both modes a
third plot draws the tokens each side holds (layer 0) step by step: a cache that frees a page at once draws a
saw-tooth, one that frees a token a step a flat line at its capacity.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.ab_session import REPEAT_N, REPEAT_WINDOW, ABTimeline

SMOOTH = 16  # tokens in the NLL plot's running mean
WARM_UP_SKIP = 32  # the perplexity axis fits the curves after this many tokens: the first tokens' spike is clipped
COLORS = {"a": theme.SERIES[1], "b": theme.SERIES[2], "full": "#e8e8e8"}  # A orange, B green, full white


def _rolling_mean(values: np.ndarray, n: int = SMOOTH) -> np.ndarray:
    """The mean of each value and the n - 1 before it, skipping NaN (NaN where all are)."""
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[n:], counts[n:] = sums[n:] - sums[:-n], counts[n:] - counts[:-n]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _pen(side: str):
    """The full cache's curve is a wide translucent band under the sides' lines: a side that stays with it
    is drawn inside it, not hidden under it."""
    if side == "full":
        color = pg.mkColor(COLORS["full"])
        color.setAlpha(110)
        return pg.mkPen(color, width=7)
    return pg.mkPen(COLORS[side], width=2.4)


def _plot(widget: pg.GraphicsLayoutWidget, left: str, bottom: str) -> pg.PlotItem:
    plot = widget.addPlot()
    theme.style_plot(plot, left=left, bottom=bottom)
    plot.setMenuEnabled(False)
    plot.hideButtons()
    return plot


class ABPlots(QWidget):
    """show(timeline, index, labels): both plots for the shown step; labels name the sides ("A window")."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.left_widget, self.right_widget = pg.GraphicsLayoutWidget(), pg.GraphicsLayoutWidget()
        self.held_widget = pg.GraphicsLayoutWidget()
        self.left = _plot(self.left_widget, "perplexity", "tokens read")
        self.right = _plot(self.right_widget, "NLL (nats)", "token")
        self.held_plot = _plot(self.held_widget, "tokens held", "step")
        self.left_labels = {self.held_plot: ("tokens held", "held")}  # each plot's left label: whole, and short
        self.left.getAxis("left").enableAutoSIPrefix(False)  # a log axis's ticks are the values themselves
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.left_widget, 3)
        layout.addWidget(self.right_widget, 2)
        layout.addWidget(self.held_widget, 2)
        self.held = {side: self.held_plot.plot(pen=pg.mkPen(COLORS[side], width=2.0))
                     for side in ("a", "b")}
        self.setMinimumHeight(150)
        self.ppl = {side: self.left.plot() for side in ("full", "a", "b")}  # the full cache's a band beneath
        self.raw = {side: self.right.plot(pen=pg.mkPen(pg.mkColor(COLORS[side]).lighter(60), width=1))
                    for side in ("a", "b")}
        self.smooth = {side: self.right.plot(pen=_pen(side)) for side in ("full", "a", "b")}
        self.evicted = {}  # teacher-forced: where each side first evicted
        for side in ("a", "b"):
            line = pg.InfiniteLine(angle=90, pen=pg.mkPen(COLORS[side], width=1, style=Qt.DotLine),
                                   label="", labelOpts={"position": 0.85, "color": COLORS[side]})
            self.left.addItem(line, ignoreBounds=True)
            line.hide()
            self.evicted[side] = line
        self.cursors = []
        self.held_cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=Qt.DashLine))
        self.held_plot.addItem(self.held_cursor, ignoreBounds=True)
        for plot in (self.left, self.right):
            cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(theme.ACCENT, style=Qt.DashLine))
            plot.addItem(cursor, ignoreBounds=True)
            self.cursors.append(cursor)
        self.forced: bool | None = None
        self.set_mode(False, ("A", "B"))

    def set_mode(self, forced: bool, labels: tuple[str, str]) -> None:
        """Teacher-forced plots or free-running ones, the sides named (e.g. "A oldest", "B sinks")."""
        self.forced = forced
        self.labels = {"a": labels[0], "b": labels[1]}
        for line in self.evicted.values():
            line.hide()
        self.left.setLogMode(y=forced)
        for plot in (self.left, self.right):
            plot._grown = (None, None)  # grow_range starts over
        for side, curve in self.ppl.items():  # free-running: "full" draws KL(A‖B), "a" / "b" the full cache's NLL
            curve.setPen(_pen(side) if forced or side != "full" else pg.mkPen(theme.SERIES[0], width=2.4))
        names = {"a": labels[0], "b": labels[1], "full": "full cache"}
        if forced:
            self.titles = {self.left: ("running perplexity", names, ("full", "a", "b"), ""),
                           self.right: (f"NLL, {SMOOTH}-token mean", names, ("full", "a", "b"), "")}
            self._decades(1)
            self.left_labels.update({self.left: ("perplexity (log)", "ppl"), self.right: ("NLL (nats)", "nats")})
            self.left.setLabel("bottom", "tokens read")
        else:
            self.titles = {self.left: ("", names, ("a", "b"), f"full cache's NLL of its tokens ({SMOOTH}-step mean, "
                                       "oracle on)", ),
                           self.right: (f"repeated {REPEAT_N}-grams, last {REPEAT_WINDOW} tokens", names, ("a", "b"),
                                        "")}
            self.left.getAxis("left").setTicks(None)
            self.left_labels.update({self.left: ("nats", "nats"), self.right: ("repetition", "rep.")})
            self.left.setLabel("bottom", "step")
        self.right.setLabel("bottom", "token" if forced else "step")
        self.held_plot.setLabel("bottom", "tokens read" if forced else "step")
        self.titles[self.held_plot] = ("tokens held", names, ("a", "b"), "")
        for curve in (*self.ppl.values(), *self.raw.values(), *self.smooth.values(), *self.held.values()):
            curve.setData([], [])
        self.held_plot._grown = (None, None)
        for plot in (self.left, self.right, self.held_plot):  # from 0, not pyqtgraph's default −0.5 .. 0.5 or a log decade
            theme.grow_range(plot, 1, 1)

        self._retitle()

    def _decades(self, top: int) -> None:
        """A log axis labels every minor tick (2, 3, ... 9 × 10^k), which overlap on a short plot: the decades
        up to 10^top only, each labelled with its value (the axis is log10 of the perplexity)."""
        self.left.getAxis("left").setTicks([[(k, f"{10 ** k:g}") for k in range(max(top, 1) + 1)], []])

    def _retitle(self) -> None:
        """Each plot's title: its legend, with the title's words (and the free-running KL key and note) only
        where the plot is wide enough for them — a narrow window keeps the legend whole rather than cut."""
        from PySide6.QtGui import QFont, QFontMetricsF

        font = QFont()
        font.setPointSizeF(10.0)
        metrics = QFontMetricsF(font)
        for plot, (title, names, sides, note) in self.titles.items():
            room = plot.titleLabel.boundingRect().width() or plot.width()
            keys = [("━", theme.SERIES[0], "KL(A‖B) until the texts part")] if not self.forced and \
                plot is self.left else []  # the KL curve is the left plot's only
            keys += [("▬" if s == "full" else "━", COLORS[s], names[s]) for s in sides]
            plain = " ".join(f"{mark} {name}" for mark, _, name in keys)
            words = [w for w in (title, note) if w]
            while words and metrics.horizontalAdvance("  ".join([*words, plain])) + 12 > room:
                words.pop()  # the note goes first, then the title's words (the axis labels say them too)
            if metrics.horizontalAdvance(plain) + 12 > room:  # too narrow for the names: the sides' letters
                keys = [(mark, color, name.split()[0]) for mark, color, name in keys]
                plain = " ".join(f"{mark} {name}" for mark, _, name in keys)
            head = f"<span style='color:{theme.TEXT}'>{title}</span>&nbsp; " if title in words else ""
            tail = f" <span style='color:{theme.TEXT}'>{note}</span>" if note in words else ""
            legend = "&nbsp; ".join(f"<span style='color:{color}'>{mark} {name}</span>" for mark, color, name in keys)
            theme.set_title(plot, head + legend + tail, size="10pt", justify="left")
            plot.setToolTip(" ".join([title, plain, note]).strip())
        self._relabel(metrics)

    def _relabel(self, metrics) -> None:
        """The left axes' labels, shortened where a short plot's axis cannot hold them whole."""
        for plot, (long, short) in self.left_labels.items():
            room = plot.getAxis("left").size().height()
            plot.setLabel("left", long if not room or metrics.horizontalAdvance(long) + 8 <= room else short)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._retitle()

    def show(self, timeline: ABTimeline | None, index: int) -> None:
        if timeline is None or index < 0:
            return
        if timeline.forced:
            self._show_forced(timeline, index)
        else:
            self._show_free(timeline, index)

    def _show_forced(self, timeline: ABTimeline, index: int) -> None:
        shown = timeline.scored_at(index)
        total = timeline.scored_at(len(timeline) - 1)
        x = np.arange(1, total + 1, dtype=np.float64)
        top = 1.0
        skip = WARM_UP_SKIP if total > 2 * WARM_UP_SKIP else 0
        for side, curve in self.ppl.items():
            ppl = timeline.running_ppl(side)
            curve.setData(x, ppl)
            top = max(top, float(ppl[skip:].max(initial=1.0)))  # the warm-up's spike leaves the top: clipped
        for side in ("full", "a", "b"):
            nll = timeline.nll(side)
            if side in self.raw:
                self.raw[side].setData(x, nll)
            kernel = np.ones(min(SMOOTH, max(len(nll), 1))) / min(SMOOTH, max(len(nll), 1))
            mean = np.convolve(nll, kernel, mode="valid") if len(nll) else nll
            self.smooth[side].setData(x[len(x) - len(mean):], mean)
        decades = float(np.log10(max(top, 10.0)))
        theme.grow_range(self.left, max(total, 16), decades * 1.05, x_step=64)
        self._decades(int(np.ceil(self.left.getViewBox().viewRange()[1][1])))
        self.right.enableAutoRange(axis="y")
        self.right.setXRange(0, max(total, 16), padding=0.02)
        for cursor in self.cursors:
            cursor.setValue(shown)
        self._show_held(timeline, timeline.series("scored"), shown)
        self._mark_evictions(timeline)

    def _mark_evictions(self, timeline: ABTimeline) -> None:
        """A dotted line where each side first evicted, labelled once per place ("first eviction: A, B")."""
        places: dict[int, list[str]] = {}
        for side, line in self.evicted.items():
            step = timeline.first_eviction(side)
            line.setVisible(step is not None)
            if step is not None:
                places.setdefault(timeline.scored_at(step), []).append(side)
        for at, sides in places.items():
            for side in sides:
                self.evicted[side].setValue(at)
                self.evicted[side].label.setFormat("" if side != sides[0] else "first eviction: " + ", ".join(
                    self.labels[s].split(" ")[0] for s in sides))

    def _show_free(self, timeline: ABTimeline, index: int) -> None:
        count = len(timeline)
        steps = np.arange(count, dtype=np.float64)
        kl = timeline.series("kl_ab")
        diverged = timeline.first_divergence()
        if diverged is not None:
            kl[diverged + 1:] = np.nan  # past the divergence KL(A‖B) compares predictions after different texts
        self.ppl["full"].setData(steps, kl, connect="finite")
        top = float(np.nanmax(kl)) if np.isfinite(kl).any() else 1.0
        for side in ("a", "b"):
            self.smooth[side].setData(steps, timeline.series(f"rep_{side}"), connect="finite")
            nll = -timeline.series(f"lp_{side}_full")
            mean = _rolling_mean(nll)
            self.ppl[side].setData(steps, mean, connect="finite")
            if np.isfinite(mean).any():
                top = max(top, float(np.nanmax(mean)))
        theme.grow_range(self.left, max(count - 1, 1), max(top, 1.0), x_step=32)
        self.right.setYRange(0, 1.05, padding=0)
        self.right.setXRange(0, max(count - 1, 1), padding=0.02)
        for cursor in self.cursors:
            cursor.setValue(max(index, 0))
        self._show_held(timeline, steps, max(index, 0))

    def _show_held(self, timeline: ABTimeline, x: np.ndarray, at: float) -> None:
        """Each side's tokens held (layer 0) per step, against `x` (tokens read, or the step)."""
        top = 1
        for side, curve in self.held.items():
            held = timeline.series(f"held_{side}")
            curve.setData(x, held)
            top = max(top, int(held.max(initial=1)))
        theme.grow_range(self.held_plot, max(float(x[-1]) if len(x) else 1, 16), top * 1.1, x_step=64)
        self.held_cursor.setValue(at)

"""Attention weights: for the selected step, layer and head (or the mean of heads), how the last query's
attention is spread over the tokens the cache holds — tokens per weight bin on a log scale, and how much of
the attention each bin carries — with the entropy and the largest weight; with the oracle on, the share of
the full cache's attention that went to tokens this cache had evicted. What it shows is what the record
holds: the recorded layers' attention (float16) and the oracle's per-head lost attention."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QWidget

from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import stacked
from pagevis.viewmodel.histogram import (
    BINS_PER_DECADE, EDGES, LOW_DECADE, WeightHistogram, weight_histogram)
from pagevis.viewmodel.view_state import EMPTY_HINT, ViewState

EVICTED_X = 0.6  # where the oracle's evicted-attention bar stands, right of the weight 1


class HistogramView(QWidget):
    title = "Weights"
    live_interval = 0.5  # while decoding, at most twice a second
    only_when_visible = True  # a tab behind the attention heatmap: drawn when raised

    def __init__(self, parent=None):
        super().__init__(parent)
        self.data: WeightHistogram | None = None  # what the bars show
        self._key = None
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.ci.setSpacing(4)
        self.tokens = self.graphics.addPlot(row=0, col=0)
        self.mass = self.graphics.addPlot(row=1, col=0)
        ticks = [[(float(x), "1" if x == 0 else f"1e{int(x)}") for x in range(LOW_DECADE, 1)] + [(EVICTED_X, "evicted")]]
        for plot, left in ((self.tokens, "tokens"), (self.mass, "share")):
            theme.style_plot(plot, left=left)
            plot.setMenuEnabled(False)
            plot.setMouseEnabled(False, False)
            plot.hideButtons()
            plot.getAxis("bottom").setTicks(ticks)
            plot.getAxis("left").setWidth(44)
            plot.setXRange(LOW_DECADE - 0.1, EVICTED_X + 0.3, padding=0)
        self.mass.setXLink(self.tokens)
        self.mass.setLabel("bottom", "attention weight (log scale)", color=theme.MUTED)
        self.mass.setYRange(0, 1, padding=0.02)
        width = 0.9 / BINS_PER_DECADE
        centres = EDGES[:-1] + 0.5 / BINS_PER_DECADE
        self.count_bars = pg.BarGraphItem(x=centres, height=np.zeros(len(centres)), width=width,
                                          brush=theme.SERIES[0], pen=None)
        self.mass_bars = pg.BarGraphItem(x=centres, height=np.zeros(len(centres)), width=width,
                                         brush=theme.SERIES[1], pen=None)
        self.evicted_bar = pg.BarGraphItem(x=[EVICTED_X], height=[0.0], width=width, brush=theme.SERIES[3], pen=None)
        self.tokens.addItem(self.count_bars)
        self.mass.addItem(self.mass_bars)
        self.mass.addItem(self.evicted_bar)
        self.hint = pg.TextItem(EMPTY_HINT, color=theme.MUTED, anchor=(0.5, 0.5))
        self.tokens.addItem(self.hint, ignoreBounds=True)
        self.hint.setPos((LOW_DECADE + EVICTED_X) / 2, 0.5)
        self.setMinimumSize(260, 180)
        stacked(self.graphics, margins=(4, 4, 4, 4), into=self)

    def export_target(self):
        return self.graphics

    def show_state(self, state: ViewState) -> None:
        record = state.record
        key = (id(state.timeline), state.index, state.layer, state.head)
        if key == self._key:
            return
        self._key = key
        self.data = weight_histogram(record, state.layer, state.head) if record is not None else None
        data = self.data
        if data is None:
            self._clear("no session" if state.timeline is None else EMPTY_HINT if record is None else
                        f"layer {state.layer}'s attention is not recorded (record layers)")
            return
        self.hint.setVisible(False)
        self.count_bars.setOpts(height=data.counts.astype(float))
        self.mass_bars.setOpts(height=data.mass)
        self.evicted_bar.setOpts(height=[data.lost or 0.0])
        self.tokens.setYRange(0, max(1, int(data.counts.max())), padding=0.05)
        uniform = np.log(data.tokens) if data.tokens else 0.0
        dropped = f" (+{data.zeros} at weight 0)" if data.zeros else ""  # dropped by this head, or below float16
        theme.set_title(self.tokens, theme.muted(theme.fit_parts(self.tokens, (
            f"layer {state.layer}", state.head_label, f"{data.tokens} tokens{dropped}",
            f"entropy {data.entropy:.2f} of {uniform:.2f} nats", f"max {data.max_weight:.3f}"))), size="9pt")
        lost = ("evicted tokens' share: turn the oracle on" if data.lost is None else
                f"■ evicted tokens would get {100 * data.lost:.1f}% of the full cache's attention")
        title = theme.fit_parts(self.mass, ("attention per bin", lost))
        red = f"<span style='color:{theme.SERIES[3]}'>■</span>"
        theme.set_title(self.mass, theme.muted(title.replace("■", red)), size="9pt")

    def _clear(self, hint: str) -> None:
        zeros = np.zeros(len(EDGES) - 1)
        self.count_bars.setOpts(height=zeros)
        self.mass_bars.setOpts(height=zeros)
        self.evicted_bar.setOpts(height=[0.0])
        self.hint.setText(hint)
        self.hint.setVisible(True)
        theme.set_title(self.tokens, "", size="9pt")
        theme.set_title(self.mass, "", size="9pt")

"""Heads: the model's head layout (query heads grouped by the KV head they share) and small multiples of
each query head's attention over the last steps, one column per KV head."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.timeline import head_label, kv_head_of
from pagevis.viewmodel.view_state import ViewState
from pagevis.gui.widgets.rgba_image import RgbaImage

ROWS = 48  # steps each small heatmap shows, ending at the selected one
COLUMNS = 160  # positions, ending at the newest written


def layout_text(n_heads: int, n_kv_heads: int) -> str:
    """'9 query heads → 3 KV heads: KV 0 ← heads 0–2 · …' (or what is known of the layout)."""
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        return f"{n_heads} query heads (KV layout unknown)"
    group = n_heads // n_kv_heads
    kind = "multi-head" if group == 1 else "multi-query" if n_kv_heads == 1 else "grouped-query"
    groups = " · ".join(f"KV {k} ← heads {k * group}–{(k + 1) * group - 1}" if group > 1 else f"KV {k} ← head {k}"
                        for k in range(n_kv_heads))
    return (f"{n_heads} query heads → {n_kv_heads} KV heads ({kind} attention: {group} query heads share each "
            f"cached K/V) · {groups}")


class HeadsView(QWidget):
    title = "Heads"
    live_interval = 0.5  # while decoding, at most twice a second
    only_when_visible = True  # one heatmap per query head: not drawn while behind the attention's tab

    def __init__(self, parent=None):
        super().__init__(parent)
        self.layout_label = QLabel("no model")
        self.layout_label.setWordWrap(True)
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.ci.setSpacing(2)
        self.plots: list[tuple[int, pg.PlotItem, RgbaImage]] = []  # (query head, plot, image)
        self.matrices: dict[int, np.ndarray] = {}  # query head -> what its small heatmap shows
        self._shape = None
        self._key = None
        self.lut = pg.colormap.get(theme.HEATMAP).getLookupTable(nPts=256, alpha=True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.layout_label)
        layout.addWidget(self.graphics, 1)

    def export_target(self):
        return self.graphics

    def _build(self, n_heads: int, n_kv_heads: int) -> None:
        self.graphics.clear()
        self.plots = []
        columns = n_kv_heads if n_kv_heads > 0 and n_heads % n_kv_heads == 0 else 1
        group = n_heads // columns
        for head in range(n_heads):
            kv = kv_head_of(head, n_heads, n_kv_heads)
            column, row = (kv, head % group) if kv is not None else (0, head)
            plot = self.graphics.addPlot(row=row, col=column)
            plot.hideAxis("left")
            plot.hideAxis("bottom")
            plot.setMenuEnabled(False)
            plot.setMouseEnabled(False, False)
            plot.hideButtons()
            plot.invertY(True)
            image = RgbaImage()
            plot.addItem(image)
            # the name inside the thumbnail's corner, not a title row above it: at 1280 × 720 eight heads'
            # titles took half the height the heatmaps had
            name = pg.TextItem(head_label(head, n_heads, n_kv_heads), color=theme.TEXT, anchor=(0, 0),
                               fill=pg.mkBrush(0, 0, 0, 150))
            plot.addItem(name, ignoreBounds=True)
            self.plots.append((head, plot, image))

    def show_state(self, state: ViewState) -> None:
        timeline = state.timeline
        key = (id(timeline), state.index, state.layer)
        if key == self._key:
            return
        self._key = key
        if timeline is None or state.record is None:
            self.layout_label.setText("no model" if timeline is None else layout_text(timeline.info.n_heads,
                                                                                     timeline.info.n_kv_heads))
            for _, _, image in self.plots:
                image.clear()
            self.matrices = {}
            return
        info = timeline.info
        if self._shape != (info.n_heads, info.n_kv_heads):
            self._shape = (info.n_heads, info.n_kv_heads)
            self.layout_label.setText(layout_text(info.n_heads, info.n_kv_heads))
            self._build(info.n_heads, info.n_kv_heads)
        self.matrices = {}
        for head, plot, image in self.plots:
            weights, evicted, _, _ = timeline.attention(state.layer, head, state.index, ROWS, COLUMNS)
            self.matrices[head] = weights
            top = float(weights.max()) if weights.size else 0.0
            index = np.clip(weights * (255.0 / top), 0, 255).astype(np.uint8) if top > 0 else \
                np.zeros(weights.shape, np.uint8)
            rgba = self.lut[index]
            rgba[evicted] = theme.EVICTED_MARK
            image.set_image(rgba, *weights.shape)
            plot.setRange(xRange=(0, max(weights.shape[1], 1)), yRange=(0, max(weights.shape[0], 1)), padding=0)

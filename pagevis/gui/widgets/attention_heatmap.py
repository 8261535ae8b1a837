"""Attention heatmap: for every step so far, the weights of that step's last query over token positions,
for one layer and head (or their mean). Positions the cache had evicted by that step are marked."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.view_state import EMPTY_HINT, ViewState
from pagevis.gui.widgets.rgba_image import RgbaImage

LOG_FLOOR = 1e-4  # the log scale's lowest level: weights below show as the floor


class AttentionView(QWidget):
    title = "Attention"

    def __init__(self, parent=None):
        super().__init__(parent)
        self.matrix = np.zeros((0, 0), dtype=np.float32)  # what is drawn (scaled), steps × positions
        self.evicted = np.zeros((0, 0), dtype=bool)
        self._key = None
        self._levels = None
        self.origin = (0, 0)  # (first step, first position) of the matrix
        self.graphics = pg.GraphicsLayoutWidget()
        self.plot = self.graphics.addPlot()
        theme.style_plot(self.plot, left="step", bottom="token position")
        self.plot.getAxis("left").setToolTip("a row per step: the attention of that step's last query")
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.plot.showGrid(x=False, y=False)
        self.image = RgbaImage()  # weights through the colour map, evicted positions marked
        self.plot.addItem(self.image)
        self.colormap = pg.colormap.get(theme.HEATMAP)
        self.lut = self.colormap.getLookupTable(nPts=256, alpha=True)
        self._lut32 = np.ascontiguousarray(self.lut, dtype=np.uint8).view(np.uint32).ravel()
        self._evicted32 = np.array(theme.EVICTED_MARK, dtype=np.uint8).view(np.uint32)[0]
        self.cursor = pg.InfiniteLine(angle=0, pen=pg.mkPen(theme.ACCENT, width=1, style=pg.QtCore.Qt.DashLine))
        self.plot.addItem(self.cursor)
        self.bar = pg.ColorBarItem(values=(0, 1), colorMap=self.colormap, interactive=False, width=14,
                                   label="attention weight", pen=theme.GRID)
        theme.cache_axes(self.bar)
        self.graphics.addItem(self.bar, row=0, col=1)
        self.hint = pg.TextItem(EMPTY_HINT, color=theme.MUTED, anchor=(0.5, 0.5))
        self.plot.addItem(self.hint, ignoreBounds=True)
        self.setMinimumSize(260, 180)  # below this the heatmap is unreadable: the window's minimum grows instead
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.graphics)

    def export_target(self):
        return self.graphics

    def show_state(self, state: ViewState) -> None:
        timeline, record = state.timeline, state.record
        key = (id(timeline), state.index, len(timeline) if timeline else 0, state.layer, state.head,
               state.log_scale, state.fixed_scale, state.loading is not None)
        if key == self._key:
            return
        if self._key is None or self._key[0] != key[0]:
            self.plot._grown = (None, None)  # a new session: fit the view afresh
        self._key = key
        self.hint.setVisible(record is None)
        self.cursor.setVisible(record is not None)
        if record is None:
            self._show_empty(state)
            return
        weights, evicted, first, low = timeline.attention(state.layer, state.head, state.index)
        if state.log_scale:
            shown = np.log10(np.maximum(weights, LOG_FLOOR))
            levels = (float(np.log10(LOG_FLOOR)), 0.0)
            label = "log₁₀ attention weight"
        else:
            shown = weights
            label = "attention weight"
            current = self._levels
            if state.fixed_scale and current is not None and current[0] == 0.0:
                levels = current  # fixed: colours compare across steps (the top stays where it was)
            else:
                positive = weights[weights > 0]
                top = float(np.percentile(positive, 99.5)) if positive.size else 1.0
                levels = (0.0, theme.level_ceiling(max(top, 1e-3)))
                if current is not None and current[0] == 0.0 and 0.7 * current[1] < top <= current[1]:
                    levels = current  # close enough below the current top: keep it (no flapping 0.1 ↔ 0.12)
        if label != getattr(self, "_bar_label", None):  # a new label re-lays the plot out: only on change
            self._bar_label = label
            self.bar.setLabel("left", label)
        if levels != self._levels:  # a new range re-lays the bar's axis out (3 ms): only on change
            self._levels = levels
            self.bar.setLevels(levels)
        self.matrix = shown  # float32: steps first.., positions low..
        self.evicted = evicted
        self.origin = (first, low)
        rows, cols = shown.shape
        self.image.setPos(low, first)
        written = timeline.written_upto[first: state.index + 1] - low
        self.image.set_image(self._rgba(shown, evicted, written, levels), rows, cols)
        self.cursor.setValue(first + rows - 0.5)
        if first == 0 and low == 0:
            if isinstance(self.plot._grown[0], tuple):
                self.plot._grown = (None, None)  # back from a sliding window
            theme.grow_range(self.plot, cols, rows, x_step=32, y_step=32, padding=0)
        elif self.plot._grown != (("window", low, low + cols), ("window", first, first + rows)):
            # a long session: the window slides with the selected step
            self.plot._grown = (("window", low, low + cols), ("window", first, first + rows))
            self.plot.disableAutoRange()
            self.plot.setXRange(low, low + cols, padding=0)
            self.plot.setYRange(first, first + rows, padding=0)
        window = "" if first == 0 and low == 0 else f"last {rows} steps, {cols} positions"
        # the parts that fit, most telling first (past 768 positions the window's part was cut mid-word)
        shown = theme.fit_parts(self.plot, [f"layer {state.layer}", state.head_label, "■ evicted", window], keep=2)
        theme.set_title(self.plot, theme.muted(shown.replace(
            "■", f"<span style='color:rgb{theme.EVICTED_MARK[:3]}'>■</span>")), size="9pt")

    def _show_empty(self, state: ViewState) -> None:
        """Before the first step: the axes the first rows will fill (the prompt's positions, 32 steps)."""
        self.matrix = np.zeros((0, 0), dtype=np.float32)
        self.image.clear()
        timeline = state.timeline
        positions = max(len(timeline.info.prompt_ids), 1) if timeline is not None else 32
        if isinstance(self.plot._grown[0], tuple):
            self.plot._grown = (None, None)  # back from a sliding window
        theme.grow_range(self.plot, positions, 32, x_step=32, y_step=32, padding=0)
        x_max, y_max = self.plot._grown
        self.hint.setPos(x_max / 2, y_max / 2)
        if timeline is None:
            self.hint.setText("loading the model…" if state.loading is not None else "no session")
            theme.set_title(self.plot, "", size="9pt")
            return
        self.hint.setText(f"{EMPTY_HINT}\n(→ decodes one token)")
        theme.set_title(self.plot, theme.muted(f"layer {state.layer} · {state.head_label} · a row per step"),
                        size="9pt")

    def _rgba(self, shown: np.ndarray, evicted: np.ndarray, written: np.ndarray, levels) -> np.ndarray:
        """The heatmap as RGBA: weights through the colour map, evicted positions marked, positions not yet
        written (right of each row's newest) transparent."""
        low, high = levels
        index = np.clip((shown - low) * (255.0 / (high - low)), 0, 255).astype(np.uint8)
        pixels = self._lut32[index]  # one uint32 per pixel: a quarter of the indexing of an RGBA lookup
        pixels[evicted] = self._evicted32
        pixels[np.arange(shown.shape[1])[None, :] >= written[:, None]] = 0
        return pixels.view(np.uint8).reshape(shown.shape + (4,))

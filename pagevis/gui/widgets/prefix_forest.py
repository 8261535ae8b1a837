"""The prefix forest: cached blocks as an icicle (forest_layout.py), each block a box under its parent, as wide as
its tokens, coloured by its class (the medium it lives in), marked when it is the newest stored, just removed,
hot (stored again soon after a removal) or held by another engine too. Hover a box for its description; click it
to select it (`clicked`).

The view knows nothing of where the blocks come from: it renders `ForestRows` (forest_rows.py, no Qt), columns
of (parent row, tokens, colour class, flags, sibling order) with callables for a row's key, hover text and label.
`ForestRows.from_rows([ForestRow(key, parent_key, tokens, colour, text, flags)...])` builds them from plain rows
(a few thousand); an adapter builds the columns directly for a million (pagevis/viewmodel/attach_forest.py for
`pagevis attach`).

Scale: `set_forest(rows)` lays out and prepares the drawing itself (fine for thousands of rows);
`set_drawing(prepare_drawing(rows, layout_forest(...)))` takes both made beforehand on a worker thread (what
the attach window does, for up to millions of rows). At most `budget` boxes are drawn one by one; whole subtrees
beyond that are drawn as hatched aggregate boxes with their block count (see forest_layout.py). Painting draws
the boxes as a few `drawRects` calls, one per colour, from QRectF lists built once per forest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QLabel, QToolTip, QVBoxLayout, QWidget

from pagevis.gui.widgets import theme
from pagevis.viewmodel.forest_layout import DEFAULT_BUDGET, ForestLayout, layout_forest
from pagevis.viewmodel.forest_rows import (
    FLAG_NAMES,
    HOT,
    NEWEST,
    REMOVED,
    SHARED,
    ColourClass,
    ForestRow,
    ForestRows,
)

__all__ = ["ColourClass", "ForestRow", "ForestRows", "PrefixForestView", "NEWEST", "REMOVED", "HOT", "SHARED"]

MARK_COLORS = {NEWEST: "#ffffff", REMOVED: "#ef4b4b", HOT: "#ffb020", SHARED: "#29c7c7"}
AGGREGATE_COLOR = "#6b7280"
MAX_LABELS = 400  # labels drawn per paint (the widest boxes first)


def _brush(color: str, alpha: int = 255, style=Qt.SolidPattern) -> QBrush:
    c = QColor(color)
    c.setAlpha(alpha)
    return QBrush(c, style)


@dataclass(frozen=True)
class ForestDrawing:
    """What the item paints, made by `prepare_drawing` on any thread (NumPy, QRectF and brushes only): the boxes
    as `drawRects` lists per brush and per mark, plus the counts the legend and summary show."""

    rows: ForestRows
    layout: ForestLayout
    boxes: np.ndarray  # drawn boxes (x0, y0, x1, y1), then the aggregates'
    box_rows: np.ndarray  # the row of each box; -1 - i for aggregate i
    fills: list  # (brush, [QRectF])
    marks: list  # (pen, [QRectF])
    aggregates: list  # [QRectF]
    blocks: int  # rows that are blocks (not ghosts)
    by_class: dict  # class name -> blocks


def prepare_drawing(rows: ForestRows, layout: ForestLayout) -> ForestDrawing:
    """The drawing of `rows` laid out as `layout` (costs about 2 µs a drawn box: 40 ms at the default budget, so
    a window at 1 M blocks makes it on its worker thread)."""
    drawn = layout.drawn
    x0, y0 = layout.x[drawn], layout.y[drawn]
    w = rows.tokens[drawn].astype(np.float64)
    h = layout.leaves[drawn].astype(np.float64)
    gap_x = np.minimum(0.06 * w, 0.5)
    gap_y = np.minimum(0.08 * h, 0.08)
    boxes = np.column_stack((x0 + gap_x, y0 + gap_y, x0 + w - gap_x, y0 + h - gap_y))
    aggs = np.column_stack((layout.agg_x0, layout.agg_y0, layout.agg_x1, layout.agg_y1))
    colour, flags, depth = rows.colour[drawn], rows.flags[drawn], layout.depth[drawn] % 2
    fills = []
    ghost = (flags & REMOVED) != 0
    for index, cls in enumerate(rows.classes):
        for parity, factor in ((0, 100), (1, 125)):  # alternate shades by depth: neighbours along x differ
            mask = (colour == index) & (depth == parity) & ~ghost
            if mask.any():
                fills.append((_brush(QColor(cls.color).darker(factor).name()), _rects(boxes[mask])))
    if ghost.any():
        fills.append((_brush(MARK_COLORS[REMOVED], 90, Qt.Dense4Pattern), _rects(boxes[ghost])))
    marks = []
    for flag, width in ((SHARED, 1.5), (HOT, 2.0), (REMOVED, 2.0), (NEWEST, 2.5)):
        mask = (flags & flag) != 0
        if mask.any():
            pen = QPen(QColor(MARK_COLORS[flag]), width)
            pen.setCosmetic(True)
            if flag == SHARED:
                pen.setStyle(Qt.DotLine)
            marks.append((pen, _rects(boxes[mask])))
    return ForestDrawing(rows, layout, np.concatenate((boxes, aggs)) if len(aggs) else boxes,
                         np.concatenate((drawn, -1 - np.arange(len(aggs)))), fills, marks, _rects(aggs),
                         int(rows.blocks().sum()), rows.count_by_class())


class ForestItem(pg.GraphicsObject):
    """Draws a laid-out forest: boxes in view coordinates (x: tokens, y: leaf slots)."""

    def __init__(self):
        super().__init__()
        self.drawing = prepare_drawing(ForestRows.empty(), layout_forest([], []))
        self._extent = QRectF()
        self._labels: dict[int, str] = {}

    @property
    def rows(self) -> ForestRows:
        return self.drawing.rows

    @property
    def layout(self) -> ForestLayout:
        return self.drawing.layout

    @property
    def boxes(self) -> np.ndarray:
        return self.drawing.boxes

    @property
    def box_rows(self) -> np.ndarray:
        return self.drawing.box_rows

    def set_drawing(self, drawing: ForestDrawing) -> None:
        self.prepareGeometryChange()
        self.drawing = drawing
        self._extent = QRectF(0, 0, max(drawing.layout.width, 1.0), max(drawing.layout.height, 1.0))
        self._labels = {}
        self.informViewBoundsChanged()  # the view box refits (unless the user zoomed: the A button refits)
        self.update()

    def boundingRect(self) -> QRectF:
        return self._extent

    def paint(self, painter: QPainter, *args) -> None:
        transform = painter.worldTransform()
        sx, sy = abs(transform.m11()), abs(transform.m22())
        outline = QPen(QColor(theme.BACKGROUND), 1)
        outline.setCosmetic(True)
        painter.setPen(outline if sy >= 6 else Qt.NoPen)  # separators only where a leaf is tall enough
        drawing = self.drawing
        for brush, rects in drawing.fills:
            painter.setBrush(brush)
            painter.drawRects(rects)
        if drawing.aggregates:
            painter.setPen(QPen(QColor(AGGREGATE_COLOR), 0))
            painter.setBrush(_brush(AGGREGATE_COLOR, 255, Qt.BDiagPattern))
            painter.drawRects(drawing.aggregates)
        painter.setBrush(Qt.NoBrush)
        for pen, rects in drawing.marks:
            painter.setPen(pen)
            painter.drawRects(rects)
        self._paint_labels(painter, sx, sy)

    def _paint_labels(self, painter: QPainter, sx: float, sy: float) -> None:
        """Labels inside boxes at least 30 px wide and 11 px tall (the widest first, at most MAX_LABELS)."""
        if not len(self.boxes) or sx <= 0 or sy <= 0:
            return
        w = (self.boxes[:, 2] - self.boxes[:, 0]) * sx
        h = (self.boxes[:, 3] - self.boxes[:, 1]) * sy
        view = self.viewRect()
        fits = (w >= 30) & (h >= 11)
        if view is not None:
            top, bottom = sorted((view.top(), view.bottom()))
            fits &= ((self.boxes[:, 2] >= view.left()) & (self.boxes[:, 0] <= view.right())
                     & (self.boxes[:, 3] >= top) & (self.boxes[:, 1] <= bottom))
        candidates = np.flatnonzero(fits)
        if not candidates.size:
            return
        candidates = candidates[np.argsort(-w[candidates], kind="stable")[:MAX_LABELS]]
        transform = painter.worldTransform()
        painter.save()
        painter.resetTransform()
        font = QFont(painter.font())
        font.setPointSizeF(7.5)
        painter.setFont(font)
        painter.setPen(QColor("#f4f6fa"))
        for i in candidates.tolist():
            text = self._label(int(self.box_rows[i]))
            if not text:
                continue
            x0, y0, x1, y1 = self.boxes[i]
            rect = transform.mapRect(QRectF(x0, y0, x1 - x0, y1 - y0)).adjusted(3, 1, -2, -1)
            painter.drawText(rect, Qt.AlignLeft | Qt.AlignVCenter | Qt.TextSingleLine,
                             painter.fontMetrics().elidedText(text, Qt.ElideRight, int(rect.width())))
        painter.restore()

    def _label(self, box_row: int) -> str:
        text = self._labels.get(box_row)
        if text is None:
            if box_row >= 0:
                text = self.rows.label(box_row)
            else:
                text = f"+{int(self.layout.agg_count[-1 - box_row]):,} blocks"
            self._labels[box_row] = text
        return text

    def box_at(self, x: float, y: float) -> int:
        """The box under view point (x, y): an index into `boxes`, or -1."""
        if not len(self.boxes):
            return -1
        b = self.boxes
        hit = np.flatnonzero((b[:, 0] <= x) & (x <= b[:, 2]) & (b[:, 1] <= y) & (y <= b[:, 3]))
        return int(hit[-1]) if hit.size else -1


def _rects(boxes: np.ndarray) -> list[QRectF]:
    return [QRectF(x0, y0, x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes.tolist()]


class PrefixForestView(QWidget):
    """The forest in a plot (zoom and pan with the mouse; the A button fits it again), a legend, hover text."""

    hovered = Signal(int)  # the row under the mouse (-1: none; aggregates are not rows)
    clicked = Signal(int)
    focus_requested = Signal(int)  # a double click: the row whose subtree to show (for an aggregate, its parent)

    def __init__(self, parent=None, budget: int = DEFAULT_BUDGET, x_label: str = "tokens into the prefix",
                 y_label: str = "branches (leaf blocks)"):
        super().__init__(parent)
        self.budget = budget
        self.rows = ForestRows.empty()
        self.layout: ForestLayout | None = None
        self.hover_text = ""
        self.hover_row = -1
        self.graphics = pg.GraphicsLayoutWidget()
        self.plot = self.graphics.addPlot()
        theme.style_plot(self.plot, left=y_label, bottom=x_label)
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.plot.getAxis("left").setStyle(showValues=False)
        self.plot.getAxis("left").setWidth(22)
        self.item = ForestItem()
        self.plot.addItem(self.item)
        self.plot.vb.setLimits(xMin=-1e9, yMin=-1e9)
        self.plot.enableAutoRange(True)
        self.empty_text = pg.TextItem("", color=theme.MUTED, anchor=(0.5, 0.5))
        self.plot.addItem(self.empty_text, ignoreBounds=True)
        self.graphics.scene().sigMouseMoved.connect(self._hover)
        self.graphics.scene().sigMouseClicked.connect(self._click)
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.summary)
        layout.addWidget(self.graphics, 1)
        layout.addWidget(self.legend)
        self.set_empty_text("no blocks yet")

    # --- data ---------------------------------------------------------------------------------------------
    def set_forest(self, rows: ForestRows, layout: ForestLayout | None = None, note: str = "") -> None:
        """Show `rows` (laid out here unless `layout` is given); `note` goes after the summary line."""
        if layout is None:
            layout = layout_forest(rows.parent, rows.tokens, rows.order, self.budget)
        self.set_drawing(prepare_drawing(rows, layout), note)

    def set_drawing(self, drawing: ForestDrawing, note: str = "") -> None:
        """Show a drawing prepared beforehand (`prepare_drawing`, on a worker thread for large forests)."""
        rows, layout = drawing.rows, drawing.layout
        self.rows, self.layout = rows, layout
        self.item.set_drawing(drawing)
        self._legend(rows, drawing.by_class)
        blocks = drawing.blocks
        ghosts = len(rows) - blocks
        parts = [f"<b>{blocks:,}</b> blocks"]
        if len(layout.agg_count):
            parts.append(f"{len(layout.drawn):,} drawn, {int(layout.agg_count.sum()):,} in "
                         f"{len(layout.agg_count):,} collapsed subtrees (hatched)")
        if ghosts:
            parts.append(f"{ghosts:,} just removed")
        if layout.cut:
            parts.append(f"<span style='color:#ff7a7a'>{layout.cut:,} in parent cycles, drawn as roots</span>")
        self.summary.setText(" · ".join(parts) + (f" · {note}" if note else ""))
        self.empty_text.setText("" if len(rows) else self._empty)
        if self.hover_row >= 0:
            self.hover_row, self.hover_text = -1, ""

    def set_empty_text(self, text: str) -> None:
        self._empty = text
        if not len(self.rows):
            self.empty_text.setText(text)
            self.empty_text.setPos(0.5, 0.5)

    def _legend(self, rows: ForestRows, counts: dict) -> None:
        swatches = [f"<span style='color:{c.color}'>&#9632;</span>&nbsp;{c.name}&nbsp;{counts.get(c.name, 0):,}"
                    for c in rows.classes]
        marks = [f"<span style='color:{MARK_COLORS[f]}'>&#9633;</span>&nbsp;{name.replace(' ', '&nbsp;')}"
                 for f, name in FLAG_NAMES.items()]
        marks.append(f"<span style='color:{AGGREGATE_COLOR}'>&#9636;</span>&nbsp;collapsed&nbsp;subtree")
        self.legend.setText("&nbsp;&nbsp; ".join(swatches + marks))

    @property
    def block_count(self) -> int:
        return self.item.drawing.blocks

    def count_by_class(self) -> dict[str, int]:
        return dict(self.item.drawing.by_class)

    def row_of(self, key: Any) -> int:
        """The row whose key is `key` (a scan: for tests and selections, not per frame); -1 if none."""
        for row in range(len(self.rows)):
            if self.rows.key(row) == key:
                return row
        return -1

    def center_of(self, row: int) -> QPointF | None:
        """The centre of `row`'s box in view coordinates, or None if it is not drawn one by one."""
        hit = np.flatnonzero(self.item.box_rows == row)
        if not hit.size:
            return None
        x0, y0, x1, y1 = self.item.boxes[hit[0]]
        return QPointF((x0 + x1) / 2, (y0 + y1) / 2)

    def widget_pos(self, point: QPointF):
        """Where view point `point` is on `self.graphics` (its viewport), in pixels."""
        scene = self.plot.vb.mapViewToScene(point)
        return self.graphics.mapFromScene(scene)

    # --- mouse --------------------------------------------------------------------------------------------
    def text_at(self, x: float, y: float) -> tuple[int, str]:
        """(what is under view point (x, y), its hover text): a row (≥ 0), an aggregate i as -2 - i, or (-1, "")."""
        box = self.item.box_at(x, y)
        if box < 0:
            return -1, ""
        row = int(self.item.box_rows[box])
        if row >= 0:
            return row, self.rows.describe(row)
        i = -1 - row
        lay = self.layout
        return -2 - i, (f"{int(lay.agg_count[i]):,} blocks in collapsed subtrees\n"
                        f"tokens {lay.agg_x0[i]:,.0f} to {lay.agg_x1[i]:,.0f} of the prefix, "
                        f"{lay.agg_y1[i] - lay.agg_y0[i]:,.0f} branches\n"
                        "(more blocks than the view draws one by one: double-click to show the subtree they "
                        "hang from)")

    def _hover(self, scene_pos) -> None:
        if not self.plot.sceneBoundingRect().contains(scene_pos):
            return
        point = self.plot.vb.mapSceneToView(scene_pos)
        row, text = self.text_at(point.x(), point.y())
        if text != self.hover_text:
            self.hover_text = text
            view_pos = self.graphics.mapFromScene(scene_pos)
            if text:
                QToolTip.showText(self.graphics.mapToGlobal(view_pos), text, self.graphics)
            else:
                QToolTip.hideText()
        if row != self.hover_row:
            self.hover_row = row
            self.hovered.emit(row if row >= 0 else -1)

    def _click(self, event) -> None:
        if event.button() != Qt.LeftButton or not self.plot.sceneBoundingRect().contains(event.scenePos()):
            return
        point = self.plot.vb.mapSceneToView(event.scenePos())
        row, _ = self.text_at(point.x(), point.y())
        if event.double():
            if row <= -2:  # an aggregate: the drawn block its subtrees hang from
                row = int(self.layout.agg_parent[-2 - row])
            if row >= 0:
                self.focus_requested.emit(row)
            return
        self.clicked.emit(row if row >= 0 else -1)

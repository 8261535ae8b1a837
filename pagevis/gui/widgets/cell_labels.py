"""The page grid's cell labels: each cell's token position, and its token's text where the cell has room, written
at screen resolution into an overlay that a step redraws only where numbers changed."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QImage, QPainter, QStaticText, QTransform

from pagevis.viewmodel.cells import CELL_TEXT_COLOR, cell_token

MIN_NUMBER_CELL = (14, 10)  # a cell's screen size (width, height) below which its number is left out
MIN_TEXT_CELL = (40, 30)  # ... and below which its token text is
MIN_PIXEL_SIZE = 6  # numbers smaller than this are left out (a cell too narrow for its digits)
DIGIT_WIDTH = 0.64  # a digit's width in the font's pixel size (DejaVu Sans: 0.636)


class CellLabels(pg.GraphicsObject):
    """Token positions written inside the cells, in screen pixels so they stay legible at any zoom, and under
    each number the token's text where the cell has room (`text_of`: position → text). They are drawn into a
    transparent overlay at screen resolution that is kept between paints: a step redraws only the cells
    whose number changed (one or two), and a paint is one image blit."""

    def __init__(self):
        super().__init__()
        self.positions = np.zeros((0, 0), dtype=np.int32)
        self.text_of = None
        self.max_pixel_size = 13  # the numbers' largest size (the presentation layout's is larger)
        self.pixel_size = 0  # the numbers' size at the last paint; 0: the cells were too small for numbers
        self.with_text = False  # did the last paint write token texts?
        self.rotated = False  # did it write the numbers upright along tall narrow cells (pages of 32 in a half)?
        self.font, self.text_font = QFont(), QFont()
        self._texts: dict[object, tuple] = {}  # number or token -> (laid-out text, half width, half height)
        self._overlay: QImage | None = None
        self._overlay_key = None  # the device geometry the overlay was drawn for
        self._drawn = np.zeros((0, 0), dtype=np.int32)  # the numbers the overlay holds
        self.setZValue(10)

    def set_positions(self, positions: np.ndarray, text_of=None) -> None:
        if positions.shape != self.positions.shape:
            self.prepareGeometryChange()
        if text_of != self.text_of:  # another session's tokens: every cell anew
            self.text_of, self._overlay_key = text_of, None
        self.positions = positions
        self.update()

    def point_size(self, logical_dpi: float = 96.0) -> float:
        """The numbers' size in points at the last paint (0 when none were written)."""
        return self.pixel_size * 72.0 / logical_dpi

    def boundingRect(self) -> QRectF:
        rows, cols = self.positions.shape
        return QRectF(0, 0, cols, rows)

    def _text(self, key, text: str, font: QFont) -> tuple:
        entry = self._texts.get(key)
        if entry is None:
            laid = QStaticText(text)
            laid.setTextFormat(Qt.PlainText)
            laid.prepare(QTransform(), font)
            size = laid.size()
            if len(self._texts) >= 4096:
                self._texts.clear()
            entry = self._texts[key] = (laid, size.width() / 2, size.height() / 2)
        return entry

    def _sizes(self, cell: QRectF) -> tuple[int, bool, bool]:
        """(the numbers' pixel size, whether token texts fit under them, whether the numbers run upright) for
        cells of this screen size: a tall narrow cell (a page of 32 in half a 1280-px window: 17 × 75 px) has
        its number turned a quarter, at twice the size it would get across."""
        digits = len(str(max(int(self.positions.max(initial=0)), 0)))  # the widest number fits its cell
        upright = int(min(cell.width() * 0.7, (cell.height() - 3) / (DIGIT_WIDTH * digits), self.max_pixel_size))
        if cell.width() < MIN_NUMBER_CELL[0] or cell.height() < MIN_NUMBER_CELL[1]:
            return (upright, False, True) if upright >= 9 and cell.height() >= MIN_NUMBER_CELL[0] else (0, False, False)
        with_text = self.text_of is not None and cell.width() >= MIN_TEXT_CELL[0] and \
            cell.height() >= MIN_TEXT_CELL[1]
        share = 0.4 if with_text else 0.5
        size = int(min(cell.height() * share, (cell.width() - 3) / (DIGIT_WIDTH * digits), self.max_pixel_size))
        if not with_text and size < 10 and upright >= max(size + 3, 9):
            return upright, False, True
        return (size, with_text, False) if size >= MIN_PIXEL_SIZE else (0, False, False)

    def paint(self, painter: QPainter, *args) -> None:
        rows, cols = self.positions.shape
        if not rows:
            return
        transform = painter.transform()
        pixel_size, with_text, rotated = self._sizes(transform.mapRect(QRectF(0, 0, 1, 1)))
        if not pixel_size:
            self.pixel_size = 0
            return  # too small to read: leave the colours alone
        if (pixel_size, with_text, rotated) != (self.pixel_size, self.with_text, self.rotated):
            self.pixel_size, self.with_text, self.rotated = pixel_size, with_text, rotated
            self.font.setPixelSize(pixel_size)
            self.text_font.setPixelSize(max(7, int(pixel_size * 0.8)))
            self._texts.clear()
        device = transform.mapRect(QRectF(0, 0, cols, rows))
        left, top = np.floor(device.left()), np.floor(device.top())
        ratio = painter.device().devicePixelRatioF() if painter.device() is not None else 1.0
        key = (transform.m11(), transform.m22(), transform.dx() - left, transform.dy() - top,
               int(np.ceil(device.width())) + 2, int(np.ceil(device.height())) + 2, pixel_size, with_text, ratio,
               rotated)
        if key != self._overlay_key or self._drawn.shape != self.positions.shape:
            self._overlay_key = key
            self._overlay = QImage(int(key[4] * ratio), int(key[5] * ratio), QImage.Format_ARGB32_Premultiplied)
            self._overlay.setDevicePixelRatio(ratio)
            self._overlay.fill(Qt.transparent)
            self._drawn = np.full(self.positions.shape, -1, dtype=np.int32)
        changed_rows, changed_cols = np.nonzero(self.positions != self._drawn)
        if changed_rows.size:
            self._draw_cells(changed_rows, changed_cols, key)
            self._drawn = self.positions.copy()
        painter.save()
        painter.resetTransform()
        painter.drawImage(QPointF(left, top), self._overlay)
        painter.restore()

    def _draw_cells(self, rows: np.ndarray, cols: np.ndarray, key) -> None:
        """Clear the given cells of the overlay and write their numbers (the view scales and translates,
        never rotates: a cell's centre is linear in its row and column)."""
        sx, sy, dx, dy = key[:4]
        width, height = abs(sx), abs(sy)
        xs = (sx * (cols + 0.5) + dx).tolist()
        ys = (sy * (rows + 0.5) + dy).tolist()
        painter = QPainter(self._overlay)
        number_color, text_color = QColor(CELL_TEXT_COLOR), QColor(CELL_TEXT_COLOR)
        text_color.setAlpha(200)
        lift = height * 0.21 if self.with_text else 0.0  # the number above the token's text
        elide = QFontMetrics(self.text_font)
        for x, y, number in zip(xs, ys, self.positions[rows, cols].tolist()):
            painter.setCompositionMode(QPainter.CompositionMode_Source)
            painter.fillRect(QRectF(x - width / 2, y - height / 2, width, height), Qt.transparent)
            painter.setCompositionMode(QPainter.CompositionMode_SourceOver)
            if number < 0:
                continue
            painter.setFont(self.font)
            painter.setPen(number_color)
            text, half_width, half_height = self._text(number, str(number), self.font)
            if self.rotated:  # read bottom to top, along the cell
                painter.save()
                painter.translate(x, y)
                painter.rotate(-90)
                painter.drawStaticText(QPointF(-half_width, -half_height), text)
                painter.restore()
                continue
            painter.drawStaticText(QPointF(x - half_width, y - lift - half_height), text)
            if self.with_text:
                token = elide.elidedText(cell_token(self.text_of(number)), Qt.ElideRight, int(width - 6))
                painter.setFont(self.text_font)
                painter.setPen(text_color)
                text, half_width, half_height = self._text(("t", token), token, self.text_font)
                painter.drawStaticText(QPointF(x - half_width, y + lift - half_height), text)
        painter.end()

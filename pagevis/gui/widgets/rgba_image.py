"""An RGBA image item for pyqtgraph plots that draws a NumPy array as one QImage."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtGui import QImage, QPainter


class RgbaImage(pg.GraphicsObject):
    """A (height, width, 4) uint8 array drawn over (0, 0)–(cols, rows) in view coordinates: no levels,
    lookup table or format conversion on the way (pyqtgraph's ImageItem re-renders all of that in Python
    on every change). The views colour their arrays themselves."""

    def __init__(self):
        super().__init__()
        self.rgba = np.zeros((0, 0, 4), dtype=np.uint8)
        self.extent = (0, 0)  # (rows, cols) in view coordinates
        self._image = QImage()

    def set_image(self, rgba: np.ndarray, rows: float, cols: float) -> None:
        if (rows, cols) != self.extent:
            self.prepareGeometryChange()
            self.extent = (rows, cols)
        self.rgba = np.ascontiguousarray(rgba, dtype=np.uint8)  # kept alive: the QImage reads this memory
        height, width = self.rgba.shape[:2]
        self._image = QImage(self.rgba.data, width, height, 4 * width, QImage.Format_RGBA8888) \
            if self.rgba.size else QImage()
        self.update()

    def clear(self) -> None:
        self.set_image(np.zeros((0, 0, 4), dtype=np.uint8), 0, 0)

    def boundingRect(self) -> QRectF:
        return QRectF(0, 0, self.extent[1], self.extent[0])

    def paint(self, painter: QPainter, *args) -> None:
        if not self._image.isNull():
            painter.drawImage(self.boundingRect(), self._image)

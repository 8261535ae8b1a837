"""Two layout helpers the windows share: widgets stacked in a column, and a splitter of them."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QSplitter, QVBoxLayout, QWidget


def stacked(*items, margins: tuple[int, int, int, int] = (0, 0, 0, 0), into: QWidget | None = None) -> QWidget:
    """A widget (or `into`) holding `items` one above the other; an item (widget, stretch) gets that stretch."""
    holder = into if into is not None else QWidget()
    layout = QVBoxLayout(holder)
    layout.setContentsMargins(*margins)
    for item in items:
        widget, stretch = item if isinstance(item, tuple) else (item, 0)
        layout.addWidget(widget, stretch)
    return holder


def splitter(orientation: Qt.Orientation, *widgets: QWidget, sizes: list[int] | None = None) -> QSplitter:
    """A QSplitter of `widgets`, first to last, at `sizes` (pixels) if given."""
    split = QSplitter(orientation)
    for widget in widgets:
        split.addWidget(widget)
    if sizes is not None:
        split.setSizes(sizes)
    return split

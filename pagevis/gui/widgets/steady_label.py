"""A label whose text changes every frame without laying out the window again.

A QLabel's setText asks its parent's layout for a new layout, and a layout's activation asks its own parent's,
up to the main window: every frame the narration, the transport's step and the status bar's step and speed
changed, the main window laid out its toolbars, docks and status bar again and repainted them all (the controls
dock, which nothing changed, was painted with every frame). A SteadyLabel sits in a holder widget without a
layout (`holder`, what goes into a toolbar or status bar): its geometry requests stop there. The holder's size
hint is the label's height and the width of its widest text so far: a wider text widens it, through one layout
(at 10, 100, 1000 steps...), and a narrower one keeps it.
"""

from __future__ import annotations

from PySide6.QtCore import QSize
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class SteadyLabel(QLabel):
    def __init__(self, text: str = "", expanding: bool = False):
        """`expanding`: the holder takes the width its layout gives it (a line across the window)."""
        super().__init__(text)
        self.expanding = expanding
        self.holder = _Holder(self)

    def setText(self, text: str) -> None:
        if text == self.text():
            return
        super().setText(text)
        if not self.expanding and self.sizeHint().width() > self.holder.width():
            self.holder.updateGeometry()  # wider than any text before: one layout, then it stays

    def fit(self, text: str) -> None:
        """Set the text and fit the holder to it, narrower too (one layout: for a new session, not every frame)."""
        if text == self.text():
            return
        super().setText(text)
        self.holder.widest = 0
        self.holder.updateGeometry()

    def refit(self) -> None:
        """Lay the holder out again after a change of the label's font, style, wrapping or fixed height."""
        self.holder.updateGeometry()


class _Holder(QWidget):
    """The label's parent, without a layout: the label fills it."""

    def __init__(self, label: SteadyLabel):
        super().__init__()
        self.label = label
        label.setParent(self)
        vertical = QSizePolicy.Fixed
        self.setSizePolicy(QSizePolicy.Expanding if label.expanding else QSizePolicy.Preferred, vertical)
        self.widest = 0

    def _height(self) -> int:
        label = self.label
        if label.minimumHeight() == label.maximumHeight():  # a fixed height (the presentation's two lines)
            return label.minimumHeight()
        return max(label.sizeHint().height(), label.minimumSizeHint().height())

    def sizeHint(self) -> QSize:
        label = self.label
        if label.expanding:
            return QSize(label.minimumWidth(), self._height())
        self.widest = max(self.widest, label.sizeHint().width(), label.minimumWidth())
        return QSize(self.widest, self._height())

    def minimumSizeHint(self) -> QSize:
        return QSize(self.label.minimumWidth(), self._height()) if self.label.expanding else self.sizeHint()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.label.setGeometry(self.rect())

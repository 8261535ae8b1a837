"""Finds text a window shows clipped: QLabels, buttons, combo boxes, table headers and cells, the status bar's
message, and pyqtgraph plot titles and axis labels whose text is wider than the space Qt gives them (measured
with the widget's own font metrics); and what is cramped: plots too small to read, axis tick labels running
into each other, a text item drawn over its plot's curves."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect
from PySide6.QtGui import QImage, QPainter, QTextDocument
from PySide6.QtWidgets import QAbstractButton, QComboBox, QLabel, QStatusBar, QTableView, QWidget

MIN_PLOT_PX = 40  # a plot's data area smaller than this on either side cannot be read


def plain(text: str) -> str:
    if "<" not in text:
        return text
    document = QTextDocument()
    document.setHtml(text)
    return document.toPlainText()


def _visible(widget: QWidget) -> bool:
    """Shown, and on the window (Qt keeps a dock behind a tab 'visible' but moves it off the window)."""
    if not widget.isVisible() or widget.width() <= 0:
        return False
    window = widget.window()
    return window.rect().intersects(QRect(widget.mapTo(window, QPoint(0, 0)), widget.size()))


def clipped_texts(root: QWidget, slack: int = 2) -> list[str]:
    """Descriptions of every visible text that does not fit its widget (empty when nothing is clipped)."""
    found = []
    for label in root.findChildren(QLabel):
        if not _visible(label) or label.wordWrap() or not label.text():
            continue
        metrics = label.fontMetrics()
        lines = plain(label.text()).splitlines() or [""]
        width = max(metrics.horizontalAdvance(line) for line in lines)
        room = label.contentsRect().width() - 2 * label.margin() - label.indent() if label.indent() > 0 else \
            label.contentsRect().width() - 2 * label.margin()
        if width > room + slack:
            found.append(f"label {label.objectName() or plain(label.text())[:40]!r}: {width} > {room}")
    for button in root.findChildren(QAbstractButton):
        if _visible(button) and button.text() and button.sizeHint().width() > button.width() + slack:
            found.append(f"button {button.text()!r}: {button.sizeHint().width()} > {button.width()}")
    for box in root.findChildren(QComboBox):
        if _visible(box) and box.currentText():
            need = box.fontMetrics().horizontalAdvance(box.currentText()) + 28  # frame and arrow
            if need > box.width() + slack:
                found.append(f"combo {box.currentText()!r}: {need} > {box.width()}")
    for table in root.findChildren(QTableView):
        if not _visible(table):
            continue
        model, header = table.model(), table.horizontalHeader()
        metrics = table.fontMetrics()
        for column in range(model.columnCount()):
            if table.isColumnHidden(column):
                continue
            left = header.sectionViewportPosition(column)  # the part of the column the viewport shows
            room = min(left + header.sectionSize(column), table.viewport().width()) - max(left, 0) - 8
            title = str(model.headerData(column, header.orientation()) or "")
            if header.fontMetrics().horizontalAdvance(title) > room + 6 + slack:
                found.append(f"{type(table).__name__} header {title!r}: wider than its column ({room + 8})")
            for row in range(min(model.rowCount(), 200)):
                if table.isRowHidden(row) or table.visualRect(model.index(row, column)).isEmpty():
                    continue
                text = str(model.index(row, column).data() or "")
                if metrics.horizontalAdvance(text) > room + slack:
                    found.append(f"{type(table).__name__} cell {text!r} (column {title!r}): wider than {room}")
                    break
    for bar in root.findChildren(QStatusBar):
        message = bar.currentMessage()
        if not _visible(bar) or not message:
            continue
        permanent = [w.geometry().left() for w in bar.findChildren(QWidget) if w.parent() is bar and w.isVisible()
                     and w.geometry().left() > 0 and not w.inherits("QSizeGrip")]
        room = min(permanent, default=bar.width()) - 8  # the message's margins
        if bar.fontMetrics().horizontalAdvance(message) > room + slack:
            found.append(f"status bar message {message[:50]!r}: wider than {room}")
    found.extend(_clipped_plot_titles(root, slack))
    return found


def _clipped_plot_titles(root: QWidget, slack: int) -> list[str]:
    import pyqtgraph as pg

    found = []
    for view in root.findChildren(pg.GraphicsView):
        if not _visible(view):
            continue
        for item in view.scene().items():
            if isinstance(item, pg.PlotItem) and item.titleLabel.isVisible() and item.titleLabel.text:
                label = item.titleLabel
                margin = label.item.document().documentMargin()
                width = label.item.boundingRect().width() - 2 * margin  # the laid-out text
                room = label.boundingRect().width()  # the space the plot gives its title
                if width > room + slack:
                    found.append(f"plot title {plain(label.text)[:50]!r}: {width:.0f} > {room:.0f}")
            if isinstance(item, pg.TextItem) and item.isVisible() and item.toPlainText():
                shown = item.mapRectToScene(item.boundingRect())
                visible = view.sceneRect() if item.parentItem() is None else None
                for plot in (i for i in view.scene().items() if isinstance(i, pg.PlotItem)):
                    if plot.vb.isAncestorOf(item):
                        visible = plot.vb.mapRectToScene(plot.vb.boundingRect())
                if visible is not None and not visible.contains(shown):
                    found.append(f"text item {item.toPlainText()[:40]!r}: outside its plot")
            if isinstance(item, pg.PlotItem) and not isinstance(item, pg.ColorBarItem) and item.isVisible():
                found.extend(_cramped_plot(item))
    return found


def _cramped_plot(plot) -> list[str]:
    import pyqtgraph as pg

    found = []
    name = plain(plot.titleLabel.text)[:30] or plot.getAxis("left").labelText or "untitled"
    box = plot.vb.boundingRect()
    if box.height() < MIN_PLOT_PX or box.width() < MIN_PLOT_PX:
        found.append(f"plot {name!r}: {box.width():.0f} × {box.height():.0f} px")
    for side in ("left", "bottom", "right"):
        axis = plot.getAxis(side)
        if not axis.isVisible():
            continue
        if axis.label.isVisible() and axis.labelText:
            margin = axis.label.document().documentMargin()
            length = axis.label.boundingRect().width() - 2 * margin
            room = axis.size().height() if side != "bottom" else axis.size().width()
            if length > room + 2:
                found.append(f"axis label {axis.labelText!r}: {length:.0f} > {room:.0f}")
        found.extend(f"axis {side} of {name!r}: {clash}" for clash in _tick_clashes(axis))
    for item in plot.vb.addedItems:
        labels = [item.label] if isinstance(item, pg.InfiniteLine) and getattr(item, "label", None) is not None else []
        labels += [item] if isinstance(item, pg.TextItem) else []
        for label in labels:
            if label.isVisible() and label.toPlainText() and _over_a_curve(plot, label):
                found.append(f"text {label.toPlainText()[:30]!r}: drawn over a curve of {name!r}")
    return found


def _tick_clashes(axis) -> list[str]:
    """Tick labels of one axis whose text boxes overlap (as the axis lays them out for painting)."""
    image = QImage(max(int(axis.width()), 1), max(int(axis.height()), 1), QImage.Format_ARGB32)
    painter = QPainter(image)
    try:
        specs = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    if specs is None:
        return []
    rects = [(rect.adjusted(1, 1, -1, -1), text) for rect, _, text in specs[2]]
    for i, (a, text_a) in enumerate(rects):
        for b, text_b in rects[i + 1:]:
            if a.intersects(b) and text_a != text_b:
                return [f"tick labels {text_a!r} and {text_b!r} overlap"]
    return []


def _over_a_curve(plot, label) -> bool:
    """Does any point of the plot's curves fall inside the label's box (in data coordinates)?"""
    import numpy as np
    import pyqtgraph as pg

    box = plot.vb.mapSceneToView(label.mapRectToScene(label.boundingRect())).boundingRect()
    for item in plot.vb.addedItems:
        if isinstance(item, (pg.PlotCurveItem, pg.PlotDataItem)) and item.isVisible():
            x, y = item.getData()
            if x is None or not len(x):
                continue
            inside = (x >= box.left()) & (x <= box.right()) & (y >= box.top()) & (y <= box.bottom())
            if np.any(inside):
                return True
    return False

"""Finds text a window shows clipped: QLabels, table headers and cells, and pyqtgraph plot titles whose text
is wider than the space Qt gives them (measured with the widget's own font metrics)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QAbstractButton, QComboBox, QLabel, QTableView, QWidget


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
            room = header.sectionSize(column) - 8
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
    return found

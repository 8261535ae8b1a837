"""Colours and the application palette: one dark theme shared by Qt widgets and pyqtgraph plots."""

from __future__ import annotations

import types

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

BACKGROUND = "#16181d"  # plot backgrounds
PANEL = "#1f2228"  # widget backgrounds
TEXT = "#d8dce3"
MUTED = "#8a919c"
ACCENT = "#4fa3ff"
GRID = "#3a3f48"

# Page-grid cell states (the values stored in PageGridView.states) and their colours live in viewmodel.cells (Qt-free:
# the HTML export colours the same states); imported above, for the views.

# Series colours for metrics, in order of use.
SERIES = ("#4fa3ff", "#ffb020", "#3ddc84", "#ef4b4b", "#b48cf2", "#29c7c7")

HEATMAP = "inferno"
EVICTED_MARK = (52, 74, 104, 255)  # RGBA of an evicted position in the attention heatmap (slate blue)


def rgb(color: str) -> np.ndarray:
    """'#rrggbb' as a float array of 0..1 components."""
    c = QColor(color)
    return np.array([c.redF(), c.greenF(), c.blueF()], dtype=np.float32)


def apply(app: QApplication) -> None:
    """Fusion style with a dark palette, and matching pyqtgraph defaults."""
    app.setStyle("Fusion")
    palette = QPalette()
    roles = {
        QPalette.Window: PANEL, QPalette.WindowText: TEXT, QPalette.Base: BACKGROUND,
        QPalette.AlternateBase: "#242830", QPalette.ToolTipBase: "#2b2f37", QPalette.ToolTipText: TEXT,
        QPalette.Text: TEXT, QPalette.Button: "#2a2e36", QPalette.ButtonText: TEXT,
        QPalette.BrightText: "#ffffff", QPalette.Highlight: ACCENT, QPalette.HighlightedText: "#0b0d10",
        QPalette.Link: ACCENT, QPalette.PlaceholderText: MUTED,
    }
    for role, color in roles.items():
        palette.setColor(role, QColor(color))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        palette.setColor(QPalette.Disabled, role, QColor("#5c626d"))
    app.setPalette(palette)
    app.setStyleSheet(
        "QDockWidget::title { background: #262a31; padding: 4px 6px; }"
        "QDockWidget { font-weight: 600; }"
        "QToolTip { color: #d8dce3; background: #2b2f37; border: 1px solid #3a3f48; }"
        "QGroupBox { font-weight: 600; border: 1px solid #333842; border-radius: 4px; margin-top: 10px; }"
        "QGroupBox::title { subcontrol-origin: margin; left: 8px; padding: 0 3px; }"
        "QLabel#inlineError { color: #ff7a7a; }"
    )
    configure_pyqtgraph()


def configure_pyqtgraph() -> None:
    pg.setConfigOptions(imageAxisOrder="row-major", background=BACKGROUND, foreground=TEXT, antialias=False)


def style_plot(plot: pg.PlotItem, left: str = "", bottom: str = "") -> None:
    """Axis labels and a faint grid, the same on every plot."""
    for name, label in (("left", left), ("bottom", bottom)):
        axis = plot.getAxis(name)
        axis.setPen(pg.mkPen(GRID))
        axis.setTextPen(pg.mkPen(MUTED))
        if label:
            plot.setLabel(name, label, color=MUTED)
    plot.showGrid(x=False, y=False)  # grid lines make each axis repaint whenever anything in the plot does
    plot.getAxis("left").setTickDensity(0.5)  # pyqtgraph's spacing ignores the labels' height: on a plot
    # 40 px high its labels ran into each other
    cache_axes(plot)


def cache_axes(plot) -> None:
    """Paint each axis into a pixmap that Qt reuses until the axis itself changes (its range, its size).
    An axis's bounding rect touches the plot area, so without the cache every curve, image or cursor that
    moves near an edge re-runs AxisItem.paint (≈ 0.3 ms, and 3 ms when its ticks must be re-laid out)."""
    for name in ("left", "bottom", "right", "top"):
        axis = plot.getAxis(name) if hasattr(plot, "getAxis") else plot.axes.get(name, {}).get("item")
        if axis is not None:
            axis.setCacheMode(axis.CacheMode.DeviceCoordinateCache)


def icon(name: str):
    """A QIcon from pagevis.resources/icons/<name>.svg (an empty icon if it is missing)."""
    import importlib.resources

    from PySide6.QtGui import QIcon

    try:
        path = importlib.resources.files("pagevis.resources") / "icons" / f"{name}.svg"
        return QIcon(str(path)) if path.is_file() else QIcon()
    except (ModuleNotFoundError, OSError):
        return QIcon()


def set_title(plot: pg.PlotItem, html: str, size: str = "8pt", justify: str = "center") -> None:
    """A plot title that never forces its plot wider than the space it gets (pyqtgraph's LabelItem asks
    for its text's full width as its minimum); text that does not fit is clipped. Setting the same
    title again costs nothing (a new one re-lays the plot out, which repaints its axes)."""
    if getattr(plot, "_title_html", None) == (html, size, justify):
        return
    plot._title_html = (html, size, justify)
    label = plot.titleLabel
    if not getattr(label, "_shrinkable", False):
        label._shrinkable = True
        label.updateMin = types.MethodType(_update_min_shrinkable, label)
        label.setFlag(label.GraphicsItemFlag.ItemClipsChildrenToShape, True)
    plot.setTitle(html, size=size, justify=justify)


def fit_parts(plot: pg.PlotItem, parts, size: str = "9pt", separator: str = " · ", keep: int = 1) -> str:
    """The leading `parts` (plain text, most important first) that fit the plot's width in one title line at
    `size`, the first `keep` always; the whole line goes to the plot's tooltip, so what a narrow plot drops
    stays readable on hover."""
    from PySide6.QtGui import QFont, QFontMetricsF

    parts = [p for p in parts if p]
    font = QFont()
    font.setPointSizeF(float(size.removesuffix("pt")))
    metrics = QFontMetricsF(font)
    label = plot.titleLabel.boundingRect().width()  # the space the plot's layout gives its title
    room = (label if label > 0 else plot.width()) - 8  # the text's margins
    shown = parts[:keep]
    for part in parts[keep:]:
        if metrics.horizontalAdvance(separator.join([*shown, part])) > room:
            break
        shown.append(part)
    whole = separator.join(parts)
    plot.setToolTip(whole if len(shown) < len(parts) else "")
    return separator.join(shown)


def _update_min_shrinkable(label) -> None:
    from PySide6.QtCore import Qt

    height = label.itemRect().height()
    label.setMinimumWidth(0)
    label.setMinimumHeight(height)
    label._sizeHint = {Qt.SizeHint.MinimumSize: (0, height), Qt.SizeHint.PreferredSize: (0, height),
                       Qt.SizeHint.MaximumSize: (-1, -1), Qt.SizeHint.MinimumDescent: (0, 0)}
    label.updateGeometry()


def cache_item(item) -> None:
    """Keep a plot item's rendering as a pixmap until its data or the view changes: a long curve (one point
    per step) is then not re-stroked every time a cursor line moves over the plot during a scrub."""
    from PySide6.QtWidgets import QGraphicsItem

    item.setCacheMode(QGraphicsItem.DeviceCoordinateCache)


def muted(text: str) -> str:
    return f"<span style='color:{MUTED}'>{text}</span>"


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k that is >= value (0 for value <= 0)."""
    if not value > 0:
        return 0.0
    exponent = 10.0 ** np.floor(np.log10(value))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * exponent >= value * (1 - 1e-9):
            return float(m * exponent)
    return float(10 * exponent)


_LEVEL_STEPS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def level_ceiling(value: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 × 10^k that is >= value: a colour scale's top that
    changes only when the data crosses one of these (a new top re-lays the colour bar's axis out, 3 ms)."""
    if not value > 0:
        return 0.0
    exponent = 10.0 ** np.floor(np.log10(value))
    for m in _LEVEL_STEPS:
        if m * exponent >= value * (1 - 1e-9):
            return float(m * exponent)
    return float(10 * exponent)


def spare_ticks(plot: pg.PlotItem, side: str = "left", label_px: float = 20.0) -> None:
    """At most one tick label per `label_px` of the axis (a major spacing of 1-2-2.5-5 × 10^k): on a plot
    50 px high over 900 positions, pyqtgraph's own choice put '0' and '200' on top of each other."""
    low, high = plot.vb.viewRange()[1 if side in ("left", "right") else 0]
    length = plot.vb.height() if side in ("left", "right") else plot.vb.width()
    if length <= 0 or high <= low:
        return
    spacing = nice_ceiling((high - low) / max(1, int(length // label_px)))
    key = (spacing, side)
    if getattr(plot, "_spare_ticks", None) != key:
        plot._spare_ticks = key
        plot.getAxis(side).setTickSpacing(spacing, spacing)


def grow_range(plot: pg.PlotItem, x_max: float | None = None, y_max: float | None = None, *,
               x_step: float = 0, y_step: float = 0, padding: float = 0.02) -> None:
    """Fit the view to data from 0 to (x_max, y_max) by growing its range in coarse steps (multiples of
    x_step / y_step, or 1-2-2.5-5 ceilings when the step is 0), and only when the data outgrows it or
    shrinks far below it: a range that changes every step would repaint every axis every frame."""

    def fit(value: float | None, current: float | None, step: float) -> float | None:
        if value is None:
            return current
        value = max(value, step or 1e-9)
        if current is not None and current / 4 < value <= current:
            return current
        return float(np.ceil(value / step) * step) if step else nice_ceiling(value)

    current = getattr(plot, "_grown", (None, None))
    grown = (fit(x_max, current[0], x_step), fit(y_max, current[1], y_step))
    if grown == current:
        return
    plot._grown = grown
    plot.disableAutoRange()
    if grown[0] is not None:
        plot.setXRange(0, grown[0], padding=padding)
    if grown[1] is not None:
        plot.setYRange(0, grown[1], padding=padding)

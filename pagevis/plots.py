"""PNG line plots for `compare`, `bench` and `eval` (and `eval`'s heatmaps), drawn with pyqtgraph's exporter off screen (no matplotlib).

The commands import this module (the benches get `line_plot` passed in); it imports pyqtgraph (and so Qt)
only inside the functions that draw, so importing it loads no Qt (tests/test_layering.py checks both). Without
a display the offscreen platform is used.
"""

from __future__ import annotations

import math
import os
import sys

Series = dict[str, tuple[list[float], list[float]]]


def _app():
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg

    pg.setConfigOptions(antialias=True, background="w", foreground="k")
    return pg, pg.mkQApp("pagevis plots")


# a qualitative palette (matplotlib's tab10 without its grey): neighbours never look alike, as hues spread evenly
# over many series did (h2o's green beside the full cache's); a reference series ("full ...") is black
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#393b79", "#637939", "#843c39")


def line_plot(path: str, series: Series, title: str, x_label: str, y_label: str, log_x: bool = False,
              log_y: bool = False, width: int = 900, height: int = 560, dashed: set[str] = frozenset(),
              x_ticks: list[float] | None = None, y_ticks: list[float] | None = None) -> str:
    """Write one plot with a line and markers per series (label -> (xs, ys)); return the path.
    `x_ticks`/`y_ticks` label exactly those values (pyqtgraph's log axes label every minor tick), and the y axis
    gets ticks up to the highest point. The legend stands beside the plot, never over its lines."""
    pg, app = _app()
    widget = pg.GraphicsLayoutWidget()
    widget.resize(width, height)
    plot = widget.addPlot(title=title)
    plot.setLabel("bottom", x_label)
    plot.setLabel("left", y_label)
    plot.showGrid(x=True, y=True, alpha=0.25)
    plot.setLogMode(x=log_x, y=log_y)
    legend = pg.LegendItem(labelTextColor="k")
    widget.addItem(legend, row=0, col=1)
    top = max((y for _, ys in series.values() for y in ys if y is not None), default=None)
    if x_ticks:
        place = math.log10 if log_x else float
        plot.getAxis("bottom").setTicks([[(place(x), f"{x:g}") for x in x_ticks]])
    if y_ticks:
        place = math.log10 if log_y else float
        plot.getAxis("left").setTicks([[(place(y), f"{y:g}") for y in _ticks_to(y_ticks, top)]])
    symbols = ("o", "s", "d", "t", "+", "x", "t1", "star", "p", "h")
    for i, (label, (xs, ys)) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if y is not None and x is not None]
        if not points:
            continue
        color = "#000000" if label.startswith("full") else PALETTE[i % len(PALETTE)]
        style = pg.QtCore.Qt.PenStyle.DashLine if label in dashed else pg.QtCore.Qt.PenStyle.SolidLine
        curve = plot.plot([p[0] for p in points], [p[1] for p in points], pen=pg.mkPen(color, width=2, style=style),
                          symbol=symbols[i % len(symbols)], symbolSize=8, symbolBrush=color, symbolPen=color)
        legend.addItem(curve, label)
    legend.setMaximumHeight(legend.layout.minimumHeight())  # its rows together, at the top of its column
    widget.ci.layout.setAlignment(legend, pg.QtCore.Qt.AlignmentFlag.AlignTop)
    if top is not None:  # the highest point inside the frame, below its own tick, not on the edge
        plot.enableAutoRange(axis="y", enable=False)
        low, high = plot.getViewBox().childrenBounds()[1] or (0, 0)
        plot.setYRange(low, high + (high - low) * 0.06, padding=0.02)
    return _export(app, widget, path, width)


def _ticks_to(ticks: list[float], top: float | None) -> list[float]:
    """The given ticks, and 1-2-2.5-5 steps above them up to the first at or over `top`."""
    ticks = sorted(ticks)
    if top is None or not ticks or ticks[-1] <= 0:
        return ticks
    while ticks[-1] < top:
        decade = 10 ** math.floor(math.log10(ticks[-1]))
        ticks.append(next(m * decade for m in (1, 2, 2.5, 5, 10) if m * decade > ticks[-1]))
    return ticks


def _export(app, widget, path: str, width: int) -> str:
    from pyqtgraph import exporters

    widget.show()  # laid out at its size (off screen when there is no display)
    app.processEvents()
    exporter = exporters.ImageExporter(widget.scene())
    exporter.parameters()["width"] = width
    exporter.export(path)
    widget.close()
    widget.deleteLater()
    return path


def heatmap_grid(path: str, panels: dict[str, list[list[float | None]]], title: str, x_labels: list[str],
                 y_labels: list[str], x_label: str, y_label: str, levels: tuple[float, float] = (0.0, 1.0),
                 columns: int = 3, panel_size: int = 300) -> str:
    """Write one heatmap per panel (label -> rows of values, rows = y_labels, columns = x_labels; None =
    not measured, drawn grey) in a grid, with one colour bar over fixed `levels`; return the path. Each
    cell is printed with its value."""
    import numpy as np

    pg, app = _app()
    columns = max(1, min(columns, len(panels)))
    rows_of_panels = -(-len(panels) // columns)
    width, height = columns * panel_size + 120, rows_of_panels * panel_size + 60
    widget = pg.GraphicsLayoutWidget()
    widget.resize(width, height)
    widget.addLabel(title, row=0, col=0, colspan=columns + 1)
    colormap = pg.colormap.get("viridis")
    image = None
    for index, (label, values) in enumerate(panels.items()):
        plot = widget.addPlot(row=1 + index // columns, col=index % columns, title=label)
        grid = np.array([[np.nan if v is None else v for v in row] for row in values], dtype=np.float32)
        image = pg.ImageItem(np.ascontiguousarray(grid.T), levels=levels, autoLevels=False)  # ImageItem is x-major
        image.setColorMap(colormap)
        plot.addItem(image)
        plot.getAxis("bottom").setTicks([[(i + 0.5, text) for i, text in enumerate(x_labels)]])
        plot.getAxis("left").setTicks([[(j + 0.5, text) for j, text in enumerate(y_labels)]])
        plot.setLabel("bottom", x_label)
        plot.setLabel("left", y_label)
        plot.invertY(True)  # depth 0 (the start of the text) at the top
        for j, row in enumerate(values):
            for i, value in enumerate(row):
                bright = value is not None and value > levels[0] + 0.6 * (levels[1] - levels[0])  # viridis' yellows
                text = pg.TextItem("-" if value is None else f"{value:.2f}", color="k" if bright else "w",
                                   anchor=(0.5, 0.5))
                text.setPos(i + 0.5, j + 0.5)
                plot.addItem(text)
    if image is not None:
        bar = pg.ColorBarItem(values=levels, colorMap=colormap, interactive=False)
        bar.setImageItem(image)
        widget.addItem(bar, row=1, col=columns, rowspan=rows_of_panels)
    return _export(app, widget, path, width)

"""PNG line plots for `compare` and `bench`, drawn with pyqtgraph's exporter off screen (no matplotlib).

They live with the app because only pagevis.gui imports Qt; the commands import this module (the benches
get `line_plot` passed in). Qt is imported only when a plot is drawn; without a display the offscreen
platform is used.
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


def line_plot(path: str, series: Series, title: str, x_label: str, y_label: str, log_x: bool = False,
              log_y: bool = False, width: int = 900, height: int = 560, dashed: set[str] = frozenset(),
              x_ticks: list[float] | None = None, y_ticks: list[float] | None = None) -> str:
    """Write one plot with a line and markers per series (label -> (xs, ys)); return the path.
    `x_ticks`/`y_ticks` label exactly those values (pyqtgraph's log axes label every minor tick)."""
    pg, app = _app()
    from pyqtgraph import exporters

    widget = pg.GraphicsLayoutWidget()
    widget.resize(width, height)
    plot = widget.addPlot(title=title)
    plot.setLabel("bottom", x_label)
    plot.setLabel("left", y_label)
    plot.showGrid(x=True, y=True, alpha=0.25)
    plot.setLogMode(x=log_x, y=log_y)
    plot.addLegend(offset=(10, 10), labelTextColor="k")
    if x_ticks:
        place = math.log10 if log_x else float
        plot.getAxis("bottom").setTicks([[(place(x), f"{x:g}") for x in x_ticks]])
    if y_ticks:
        place = math.log10 if log_y else float
        plot.getAxis("left").setTicks([[(place(y), f"{y:g}") for y in y_ticks]])
    symbols = ("o", "s", "d", "t", "+", "x", "t1", "star", "p", "h")
    for i, (label, (xs, ys)) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if y is not None and x is not None]
        if not points:
            continue
        color = pg.intColor(i, hues=max(len(series), 1), values=1, maxValue=200)
        style = pg.QtCore.Qt.PenStyle.DashLine if label in dashed else pg.QtCore.Qt.PenStyle.SolidLine
        plot.plot([p[0] for p in points], [p[1] for p in points], name=label,
                  pen=pg.mkPen(color, width=2, style=style), symbol=symbols[i % len(symbols)], symbolSize=8,
                  symbolBrush=color, symbolPen=color)
    widget.show()  # laid out at its size (off screen when there is no display)
    app.processEvents()
    exporter = exporters.ImageExporter(widget.scene())
    exporter.parameters()["width"] = width
    exporter.export(path)
    widget.close()
    widget.deleteLater()
    return path

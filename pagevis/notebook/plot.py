"""A line plot as inline SVG: what pagevis.plots.line_plot draws as a PNG (the same series and layout, from
pagevis.cli.compare.plot_series), for a notebook's output, without Qt and without a file."""

from __future__ import annotations

import colorsys
import html
import math

WIDTH, HEIGHT = 680, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 160, 36, 52  # margins: the legend sits on the right


def _color(index: int, count: int) -> str:
    """pyqtgraph's intColor(i, hues=count, values=1, maxValue=200), the PNG's colour of series i."""
    r, g, b = colorsys.hsv_to_rgb((index % max(count, 1)) / max(count, 1), 1.0, 200 / 255)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _scale(values: list[float], log: bool, low: float, high: float):
    """value -> pixel along an axis from `low` to `high` pixels, over the values' range (log10 if `log`)."""
    place = math.log10 if log else float
    placed = [place(v) for v in values]
    first, last = min(placed), max(placed)
    if last - first < 1e-12:
        first, last = first - 0.5, last + 0.5
    pad = (last - first) * 0.06
    first, last = first - pad, last + pad
    return lambda v: low + (place(v) - first) / (last - first) * (high - low)


def svg_line_plot(series: dict, title: str, x_label: str, y_label: str, log_x: bool = False, log_y: bool = False,
                  dashed=frozenset(), x_ticks=None, y_ticks=None) -> str:
    """One SVG element: a line with markers per series (label -> (xs, ys)), a legend, labelled ticks."""
    points = {label: [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None and (not log_y or y > 0)]
              for label, (xs, ys) in series.items()}
    xs = [x for p in points.values() for x, _ in p] or [1.0]
    ys = [y for p in points.values() for _, y in p] or [1.0]
    fx = _scale(xs, log_x, LEFT, WIDTH - RIGHT)
    fy = _scale(ys, log_y, HEIGHT - BOTTOM, TOP)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
           'font-family="system-ui, sans-serif" font-size="11" style="background:#fff">',
           f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" fill="none" '
           'stroke="#888"/>']
    for x in x_ticks or sorted(set(xs)):
        out.append(f'<line x1="{fx(x):.1f}" x2="{fx(x):.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#0002"/>'
                   f'<text x="{fx(x):.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">{x:g}</text>')
    for y in y_ticks or _ticks(ys):
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{fy(y):.1f}" y2="{fy(y):.1f}" stroke="#0002"/>'
                   f'<text x="{LEFT - 6}" y="{fy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 14}" text-anchor="middle">'
               f'{html.escape(x_label)}</text>')
    out.append(f'<text transform="translate(16 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
               f'{html.escape(y_label)}</text>')
    for i, (label, pts) in enumerate(points.items()):
        color, dash = _color(i, len(points)), ' stroke-dasharray="6 4"' if label in dashed else ""
        path = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in pts)
        out.append(f'<g><title>{html.escape(label)}</title><polyline points="{path}" fill="none" stroke="{color}" '
                   f'stroke-width="2"{dash}/>' + "".join(f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="3.5" '
                                                         f'fill="{color}"><title>{html.escape(label)}: {y:.3f} at '
                                                         f'{x:g}</title></circle>' for x, y in pts) + "</g>")
        legend_y = TOP + 8 + 16 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{color}" stroke-width="2"{dash}/><text x="{WIDTH - RIGHT + 38}" y="{legend_y + 4}">'
                   f'{html.escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def _ticks(values: list[float]) -> list[float]:
    low, high = min(values), max(values)
    if high <= low:
        return [low]
    step = 10 ** math.floor(math.log10((high - low) / 4))
    return [k * step for k in range(math.ceil(low / step), math.floor(high / step) + 1)][:12]

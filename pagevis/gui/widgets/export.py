"""Exports: a view to PNG or SVG, the eviction events and the per-step metrics to CSV."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from PySide6.QtCore import QPoint, QRect, QSize
from PySide6.QtGui import QPainter
from PySide6.QtSvg import QSvgGenerator
from PySide6.QtWidgets import QWidget

from pagevis.kvcache.layer_spec import layer_specs
from pagevis.viewmodel.timeline import Timeline

EVENT_COLUMNS = ("step", "layer", "page", "slot", "position", "token", "reason", "score")
METRIC_COLUMNS = ("step", "kind", "tokens", "resident_tokens", "pages_used", "evictions", "evictions_total",
                  "latency_ms", "kl", "top1_agree", "lost_attention")


def save_widget(widget: QWidget, path: str) -> None:
    """PNG (or any raster format Qt knows) from the widget's pixels. SVG: a pyqtgraph scene through
    pyqtgraph's SVG exporter (true vectors), any other widget painted into a QSvgGenerator."""
    if Path(path).suffix.lower() == ".svg":
        import pyqtgraph as pg
        import pyqtgraph.exporters  # noqa: F401  - registers pg.exporters

        if isinstance(widget, pg.GraphicsView):
            try:
                pg.exporters.SVGExporter(widget.scene()).export(path)
                return
            except ValueError:  # pyqtgraph's path parser trips on some items; paint the widget instead
                pass
        generator = QSvgGenerator()
        generator.setFileName(path)
        generator.setSize(widget.size())
        generator.setViewBox(QRect(0, 0, widget.width(), widget.height()))
        generator.setTitle(widget.windowTitle() or "pagevis view")
        painter = QPainter(generator)
        try:
            QWidget.render(widget, painter, QPoint())  # the widget, not a QGraphicsView's scene
        finally:
            painter.end()
        return
    if not widget.grab().save(path):
        raise OSError(f"could not write {path}")


def save_events_csv(timeline: Timeline, path: str, upto: int | None = None) -> int:
    """Every eviction (all layers) of records 0..upto; returns the number of rows written."""
    count = timeline.evictions_until(len(timeline) - 1 if upto is None else upto)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(EVENT_COLUMNS)
        for e in timeline.evictions[:count]:
            writer.writerow((e.step, e.layer, e.page, e.slot, e.position, e.token, e.reason, e.score))
    return count


def save_metrics_csv(timeline: Timeline, path: str) -> int:
    """One row per record: occupancy (layer 0's), evictions, latency and the oracle's figures; on a model with
    sliding-window layers also, per kind of layer, the most tokens one of its layers holds."""
    evictions = timeline.evictions_per_step()
    kinds = _resident_by_kind(timeline)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(METRIC_COLUMNS + tuple(f"resident_tokens {label}" for label in kinds))
        for i, r in enumerate(timeline.records):
            o = r.oracle
            writer.writerow((r.step, r.kind, len(r.token_ids), r.resident_tokens, r.pages_used, int(evictions[i]),
                             r.evictions_total, round(r.timings.get("total", float("nan")) * 1e3, 3),
                             o.kl if o else "", int(o.top1_agree) if o else "", o.lost_attention if o else "",
                             *(int(resident[i]) for resident in kinds.values())))
    return len(timeline.records)


def _resident_by_kind(timeline: Timeline) -> dict:
    """Per kind of layer ('local W=...', 'global') of a hybrid model, the most tokens one of its layers holds after
    each record; empty when every layer is of one kind."""
    windows = timeline.info.sliding_windows
    if windows is None:
        return {}
    kinds: dict[str, list[int]] = {}
    for layer, spec in enumerate(layer_specs(windows, len(windows))):
        kinds.setdefault(spec.label, []).append(layer)
    if len(kinds) < 2:
        return {}
    return {label: np.max([timeline.resident_per_step(layer) for layer in layers], axis=0)
            for label, layers in kinds.items()}


def default_size() -> QSize:
    return QSize(1600, 1000)

"""The Server window attached to a running `pagevis serve`: what its KV events and its /metrics alone can show.

The events (`pagevis serve --kv-events-endpoint`, vLLM's format) say which full pages the server's prefix cache
holds, under which parent, with their tokens: the prefix forest, rebuilt by `pagevis attach`'s subscriber and
drawn by the same forest widget as the Server window's own (and the attach window's workers, reused). /metrics
says, over time, what the plots of the Server window show: tokens generated (throughput), time to first token
and inter-token latency (the histograms' sums and counts between two scrapes), KV usage, the prefix-cache hit
rate, preemptions, and how many requests run and wait.

What neither says — which request holds a page, reference counts, which requests are in each queue, each
request's timeline, the batch of each step — needs the engine itself: the Server window's own servers. The window
says so instead of drawing those views.
"""

from __future__ import annotations


from PySide6.QtCore import QTimer, Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from pagevis.gui.widgets.windows import add_close_keys
from pagevis.gui.widgets import theme
from pagevis.gui.widgets.layout import splitter, stacked
from pagevis.gui.attach.worker import FleetWorker, ForestWorker, LiveSource, MetricsWorker
from pagevis.gui.widgets.prefix_forest import PrefixForestView
from pagevis.gui.server.plots import SIDE_COLORS, ServerPlots
from pagevis.viewmodel.server_series import MetricsSeries, scrape_serve

NOT_FROM_EVENTS = ("which request holds a page, reference counts, which requests wait, run or were preempted, "
                   "each request's timeline and each step's batch are not in the events or the metrics: they "
                   "need the engine itself (the Server window's own servers)")


def detokenizer_for(spec):
    """Token ids -> text with the model's tokenizer, read without loading the weights (a GGUF's vocabulary);
    None if it cannot be read (the forest then shows no text)."""
    try:
        if spec.kind == "synthetic":
            return spec.load().tokenizer.decode
        from pagevis.attach.tokens import load_detokenizer
        from pagevis.model.locate import default_model_path

        return load_detokenizer(spec.path or default_model_path())
    except (ValueError, OSError):
        return None


class ServeMetricsWorker(MetricsWorker):
    """The attach window's scraper, for `pagevis serve`'s metric names: its history is a MetricsSeries."""

    scrape = staticmethod(scrape_serve)

    def __init__(self, url: str, interval_s: float = 1.0, parent=None):
        super().__init__(url, interval_s, parent)
        self.history = MetricsSeries()

    def snapshot(self) -> MetricsSeries:
        copy = MetricsSeries(self.history.side)
        with self._lock:
            copy.samples = list(self.history.samples)
        return copy


class AttachedServerWindow(QWidget):
    """The Server window's forest and plots for a running `pagevis serve` (see the module docstring).

    `events`: the server's KV-event endpoint, optionally ",REPLAY" (so the forest is rebuilt from the start);
    `metrics_url`: its /metrics. Either may be None. `detokenizer`: ids -> text for the pages' text."""

    def __init__(self, events: str | None, metrics_url: str | None, detokenizer=None, parent=None):
        super().__init__(parent, Qt.Window)
        self.setWindowTitle("pagevis — server, attached: " + " · ".join(x for x in (events, metrics_url) if x))
        self.events, self.metrics_url = events, metrics_url
        self.forest = PrefixForestView(x_label="tokens into the prompt", y_label="branches")
        self.forest.set_empty_text("no cached page yet" if events else "no --server-events endpoint given")
        self.plots = ServerPlots()
        self.numbers = QLabel()
        self.numbers.setTextFormat(Qt.RichText)
        self.numbers.setFixedHeight(self.numbers.fontMetrics().lineSpacing() * 2 + 4)
        self.numbers.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        self.header = QLabel(f"Attached to a running server. From its KV events ({events or 'none'}): the pages "
                             f"of its prefix cache. From its /metrics ({metrics_url or 'none'}): the plots. "
                             f"{NOT_FROM_EVENTS[0].upper()}{NOT_FROM_EVENTS[1:]}.")
        self.header.setWordWrap(True)
        self.status = QLabel()
        self.status.setFixedHeight(self.status.fontMetrics().lineSpacing() + 4)
        self.status.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        body = splitter(Qt.Horizontal, self.forest, stacked(self.numbers, (self.plots, 1)), sizes=[800, 700])
        layout = QVBoxLayout(self)
        layout.addWidget(self.header)
        layout.addWidget(body, 1)
        row = QHBoxLayout()
        row.addWidget(self.status, 1)
        layout.addLayout(row)
        self.forest_worker = self.fleet_worker = self.metrics_worker = None
        if events:
            from pagevis.attach.subscriber import parse_source

            self.forest_worker = ForestWorker(detokenizer, min_interval_s=0.25, parent=self)
            self.fleet_worker = FleetWorker(LiveSource([parse_source(events)]), self.forest_worker, parent=self)
            self.forest_worker.start()
            self.fleet_worker.start()
        if metrics_url:
            self.metrics_worker = ServeMetricsWorker(metrics_url, parent=self)
            self.metrics_worker.start()
        self.shown_forest = None
        self.series = MetricsSeries()
        self.timer = QTimer(self)
        self.timer.setInterval(250)  # the forest renews at most 4 times a second, the metrics once
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self.resize(1600, 1000)
        add_close_keys(self)

    def refresh(self) -> None:
        """Take the workers' newest frames (the UI thread only swaps them in)."""
        parts = []
        if self.forest_worker is not None:
            frame = self.forest_worker.latest
            if frame is not None and frame is not self.shown_forest:
                self.shown_forest = frame
                counters = frame.forest.engine.counters
                self.forest.set_drawing(frame.drawing, note=f"{counters.batches} event batches")
            fleet = self.fleet_worker.latest
            if fleet is not None and fleet.engines:
                line = fleet.engines[0]
                parts.append(f"events: {sum(line.resident.values())} cached pages")
            error = (fleet.error if fleet is not None else "") or self.forest_worker.error
            if error:
                parts.append(f"<span style='color:#ff7a7a'>{error}</span>")
        if self.metrics_worker is not None:
            series = self.metrics_worker.snapshot()
            if len(series) != len(self.series):
                self.series = series
                self.plots.show_state({"A": series})
                self.numbers.setText(self.plots.numbers_html() + self._queues())
            if self.metrics_worker.error:
                parts.append(f"<span style='color:#ff7a7a'>metrics: {self.metrics_worker.error}</span>")
        self.status.setText(" · ".join(parts) or theme.muted("waiting for the server"))

    def _queues(self) -> str:
        s = self.series.samples[-1] if self.series.samples else None
        if s is None:
            return ""
        return (f" │ <span style='color:{SIDE_COLORS['A']}'>{s.running:.0f} running, {s.waiting:.0f} waiting, "
                f"{s.preemptions:.0f} preemptions</span> (counts only)")

    def closeEvent(self, event) -> None:
        self.timer.stop()
        for worker in (self.fleet_worker, self.forest_worker, self.metrics_worker):
            if worker is not None:
                worker.stop()
        super().closeEvent(event)

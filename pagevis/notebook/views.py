"""What the API's objects show inline: HTML made from the same view model and page as the HTML export
(pagevis.export.html: the page grid, the text with what was evicted, the narration and the scrubber), each
output with element ids of its own so that many sit in one notebook. Self-contained: inline CSS, JS and SVG."""

from __future__ import annotations

import itertools
import os

_ids = itertools.count()


class HtmlView:
    """An HTML fragment that Jupyter (and VS Code, Colab, nbconvert) shows as it is."""

    def __init__(self, html: str):
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"<pagevis view, {len(self.html)} characters of HTML>"


def unique_prefix() -> str:
    """Element ids of one output: unique in this kernel and across kernels writing into one notebook."""
    return f"pv{os.getpid():x}-{next(_ids)}-"


def session_view(trace, layer: int = 0, step: int | None = None, model_label: str | None = None) -> HtmlView:
    """The session view of a trace (pagevis.trace.Trace) at `layer`, opening at `step` (default the last)."""
    from pagevis.export.html import page_data, render_view
    from pagevis.viewmodel.timeline import timeline_from_trace

    timeline = timeline_from_trace(trace)
    try:
        data = page_data(timeline, layer)
    finally:
        timeline.spill.close()
    if model_label:
        data["model"] = model_label
    return HtmlView(render_view(data, unique_prefix(), start=step))

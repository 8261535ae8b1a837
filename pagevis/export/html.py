"""A session as one self-contained HTML page: the page grid of one layer, the text and the eviction events,
scrubbable by step (a slider, the arrow keys, Home / End, Space to play, and the URL's #step=N). It opens in
any browser without pagevis: no network, no files beside it; the data sits in the page as JSON.

Compact, bounded size: the grid travels as changes — per step, (cell, state, position) for each slot whose
state or token changed (a decode step: the written slot, an evicted one, and the previous step's marks
reverting, ~3 cells), and the page rebuilds any step by applying them from step 0. Per step that is ~15 bytes
+ 12 per changed cell + the narration line (~150 bytes, at most ~400: three evictions are named, more are
counted) + the eviction rows of the layer (~25 bytes each); per token its text (~8 bytes). 200 decode steps of
SmolLM2: ~60 KiB of data in a ~70 KiB page. A page over MAX_BYTES is refused.
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import in_layer
from pagevis.viewmodel.cells import CELL_TEXT_COLOR, LEGEND_NOTE, STATE_COLORS, STATE_NAMES, cell_states, legend_states
from pagevis.viewmodel.narration import narrate

MAX_BYTES = 64 << 20  # a browser opens this fast; a longer session is better sent as a video
KINDS = ("prefill", "decode")


class HtmlExportError(ValueError):
    """A page that cannot be written: one line saying why."""


def page_data(timeline, layer: int = 0) -> dict:
    """What the page shows of `timeline` (pagevis.viewmodel.timeline.Timeline) at `layer`, as plain JSON types."""
    info = timeline.info
    if not 0 <= layer < info.n_layers:
        raise HtmlExportError(f"layer {layer}: the session has layers 0 to {info.n_layers - 1}")
    config = info.config
    reasons: dict[str, int] = {}
    steps, cells, narration, events = [], [], [], []
    previous = None
    for i in range(len(timeline)):
        record = timeline.record(i)
        states = cell_states(record, layer).ravel()
        positions = record.slot_maps[layer].ravel()
        now = np.stack([states.astype(np.int64), positions.astype(np.int64)])
        changed = np.arange(states.size) if previous is None else np.flatnonzero((now != previous).any(axis=0))
        previous = now
        cells.append(np.stack([changed, states[changed], positions[changed]], axis=1).ravel().tolist())
        steps.append([int(record.step), KINDS.index(record.kind), timeline.n_positions(i),
                      int(record.resident_tokens), int(record.evictions_total), record.next_text])
        narration.append(narrate(record, layer, timeline.position_text, config.policy))
        evicted = [e for e in in_layer(record.events, layer) if e.kind is EventKind.EVICT]
        events.append([[e.page, e.slot, e.position, reasons.setdefault(e.reason or "", len(reasons)),
                        _score(e.score)] for e in evicted])
    n_positions = timeline.n_positions(len(timeline) - 1) if len(timeline) else 0
    return {
        "model": info.model_label, "prompt": info.prompt, "layer": layer, "layers": info.n_layers,
        "pages": int(config.max_pages), "slots": int(config.page_size), "policy": config.policy,
        "dtype": config.dtype, "prompt_tokens": len(info.prompt_ids),
        "names": list(STATE_NAMES), "colors": list(STATE_COLORS), "cell_text": CELL_TEXT_COLOR,
        "legend": legend_states(info.sliding_windows is not None), "legend_note": LEGEND_NOTE, "kinds": list(KINDS), "reasons": list(reasons),
        "tokens": [timeline.position_text(p) for p in range(n_positions)],
        "steps": steps, "cells": cells, "narration": narration, "events": events,
    }


def _score(score) -> float | None:
    return round(float(score), 4) if score is not None and np.isfinite(score) else None


def render(data: dict) -> str:
    """The page: the template with the data embedded (a JSON script block, `</` escaped so no text ends it)."""
    template = resources.files("pagevis.export").joinpath("page.html").read_text(encoding="utf-8")
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    title = f"pagevis · {data['model']} · {data['policy']}, {data['pages']} × {data['slots']}"
    return template.replace("{{title}}", html.escape(title)).replace("{{data}}", payload)


def write_html(path: str, timeline, layer: int = 0) -> int:
    """Write the page for `timeline` at `layer` to `path` (through path.partial, renamed): its size in bytes."""
    if not len(timeline):
        raise HtmlExportError("nothing to export: the session has no steps yet")
    text = render(page_data(timeline, layer)).encode("utf-8")
    if len(text) > MAX_BYTES:
        raise HtmlExportError(f"{path}: the page would take {len(text) >> 20} MiB, more than {MAX_BYTES >> 20} MiB; "
                              "export a shorter session, or record a video of it")
    partial = Path(f"{path}.partial")
    partial.write_bytes(text)
    os.replace(partial, path)
    return len(text)

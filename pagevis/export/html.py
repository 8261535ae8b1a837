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
import re
from importlib import resources
from pathlib import Path

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import in_layer
from pagevis.viewmodel.cells import (CELL_TEXT_COLOR, LEGEND_NOTE, STATE_COLORS, STATE_NAMES, cell_states, cell_token,
                                     legend_states)
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
        "cell_tokens": [cell_token(timeline.position_text(p)) for p in range(n_positions)],  # as the app's cells
        "steps": steps, "cells": cells, "narration": narration, "events": events,
    }


def _score(score) -> float | None:
    return round(float(score), 4) if score is not None and np.isfinite(score) else None


def render(data: dict) -> str:
    """The page: the view (view.html) in a document of its own (page.html), its data embedded as JSON."""
    title = f"pagevis · {data['model']} · {data['policy']}, {data['pages']} × {data['slots']}"
    return _fill("page.html", {"title": html.escape(title), "view": render_view(data, standalone=True)})


def render_view(data: dict, prefix: str = "", standalone: bool = False, start: int | None = None) -> str:
    """The session's view as one HTML element (its style and script inside it): the page's whole body, or one
    view among others in a page (a notebook's output) when its element ids start with `prefix`. `start`: the
    step it opens at (default the last; the page's address says it). Without scripts (a notebook shown where they
    do not run) it still shows that step's grid, text and narration, drawn here."""
    last = len(data["steps"]) - 1
    start = last if start is None else max(0, min(last, start))
    static = {"grid": "", "text": "", "narration": "", "where": ""} if standalone else _drawn(data, start)
    payload = json.dumps({**data, "start": start}, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    fields = {
        "p": prefix, "standalone": "true" if standalone else "false", "cell_text": data["cell_text"],
        "slots": str(data["slots"]), "layer": str(data["layer"]), "last": str(last), "start": str(start),
        "heading": html.escape(f"{data['model']} — paged KV cache, {last + 1} steps"),
        "config": html.escape(f"{data['pages']} pages × {data['slots']} tokens · policy {data['policy']} · "
                              f"{data['dtype']} · layer {data['layer']} of {data['layers']} · prompt "
                              f"{data['prompt_tokens']} tokens"),
        "legend": "".join(f'<span style="--c:{data["colors"][i]}">{html.escape(data["names"][i])}</span>'
                          for i in data["legend"]) + f'<em class="muted">{html.escape(data["legend_note"])}</em>',
        **static, "data": payload.replace("</", "<\\/"),  # no text in the data ends its script block
    }
    return _fill("view.html", fields)


def _fill(name: str, fields: dict[str, str]) -> str:
    """The template `name` with its {{placeholders}} replaced in one pass (no value is read as a placeholder)."""
    template = resources.files("pagevis.export").joinpath(name).read_text(encoding="utf-8")
    return re.sub(r"\{\{(\w+)\}\}", lambda match: fields[match.group(1)], template)


def _drawn(data: dict, index: int) -> dict[str, str]:
    """The grid, text and narration at step `index` as HTML, for a view whose script may not run: the page's
    changes applied up to that step, as its script applies them."""
    n = data["pages"] * data["slots"]
    states, positions = np.zeros(n, np.int64), np.full(n, -1, np.int64)
    for changes in data["cells"][: index + 1]:
        c = np.asarray(changes, np.int64).reshape(-1, 3)
        states[c[:, 0]], positions[c[:, 0]] = c[:, 1], c[:, 2]
    cells = []
    for page in range(data["pages"]):
        cells.append(f'<div class="page">{page}</div>')
        for k in range(page * data["slots"], (page + 1) * data["slots"]):
            shown, token = ("", "") if positions[k] < 0 else (str(positions[k]), data["cell_tokens"][positions[k]])
            cells.append(f'<div class="cell" style="background:{data["colors"][states[k]]}" '
                         f'data-token="{html.escape(token)}">{shown}</div>')
    evicted = {e[2] for step in data["events"][: index + 1] for e in step}
    step, kind, written, resident, evictions, next_text = data["steps"][index]
    spans = []
    for position, token in enumerate(data["tokens"][:written]):
        kinds = ("prompt" if position < data["prompt_tokens"] else "") + (" evicted" if position in evicted else "")
        spans.append(f'<span class="{kinds.strip()}">{html.escape(token)}</span>')
    spans.append(f'<span class="next">{html.escape(next_text)}</span>')
    where = (f"step {step} / {data['steps'][-1][0]} · {data['kinds'][kind]} · {resident} resident · {evictions} "
             "evicted (all layers)")
    return {"grid": "".join(cells), "text": "".join(spans), "narration": html.escape(data["narration"][index]),
            "where": html.escape(where)}


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

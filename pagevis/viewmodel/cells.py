"""The page grid's cell states, Qt-free: what each physical slot of one layer shows at one record (free,
resident, protected, written this step, evicted and rewritten, evicted this step, slid out of a local layer's
window). The app's page grid and the
HTML export (pagevis.export.html) colour the same states."""

from __future__ import annotations

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import in_layer

FREE, RESIDENT, PINNED, WRITTEN, REPLACED, EVICTED, SLID = range(7)
STATE_NAMES = ("free", "resident", "protected (sink / recent)", "written this step", "evicted + rewritten",
               "evicted this step", "slid out of the window")
STATE_COLORS = ("#2a2e36", "#3b82c4", "#b48cf2", "#3ddc84", "#ffb020", "#ef4b4b", "#8c6a3f")
CELL_TEXT_COLOR = "#ffffff"  # the numbers written in the cells (the app's grid and the HTML page's)
LEGEND_NOTE = "numbers: token positions"  # said after the colours, in the app and the HTML page


def legend_states(hybrid: bool) -> list[int]:
    """The states a grid's legend names, in order: 'slid out of the window' only for a hybrid cache (a model
    with sliding-window layers), where pages leave the window; elsewhere it never shows."""
    return [state for state in range(len(STATE_NAMES)) if hybrid or state != SLID]


def frames_of_pages(record, layer: int) -> dict[int, int]:
    """Page id -> RAM frame for the layer's pages in RAM (without a disk tier, a page id is its frame)."""
    table = record.block_tables[layer]
    if record.tiers is None:
        return {int(p): int(p) for p in table}
    return {int(p): int(f) for p, f in zip(table, record.tiers.block_frames[layer], strict=True) if f >= 0}


def cell_states(record, layer: int) -> np.ndarray:
    """(max_pages, page_size) int8 of theme states for one layer of one record."""
    slots = record.slot_maps[layer]
    frame_of = frames_of_pages(record, layer) if record.tiers is not None else None
    states = np.where(slots >= 0, RESIDENT, FREE).astype(np.int8)
    states[record.protected[layer] & (slots >= 0)] = PINNED
    written = np.zeros(slots.shape, dtype=bool)
    evicted = np.zeros(slots.shape, dtype=bool)
    slid = []
    for event in in_layer(record.events, layer):
        if event.kind is EventKind.SLIDE and frame_of is None and event.page not in record.block_tables[layer]:
            slid.append(event.page)  # the whole page left the window (and the pool)
        if event.slot < 0:
            continue
        frame = event.page if frame_of is None else frame_of.get(event.page, -1)
        if frame < 0:
            continue  # a token evicted from a page on disk: the disk strip shows it
        if event.kind is EventKind.WRITE:
            written[frame, event.slot] = True
        elif event.kind is EventKind.EVICT:
            evicted[frame, event.slot] = True
    states[evicted & (slots < 0)] = EVICTED
    states[written] = WRITTEN
    states[written & evicted] = REPLACED
    for page in slid:  # written and slid out in one step (a prefill longer than the window): slid
        states[page][slots[page] < 0] = SLID
    return states

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


# --- what the page grid draws besides the states (the app's and the HTML page's) ------------------------------
DISK_STATES = ("free", "on disk", "in RAM", "read from disk this step", "swapped out this step")  # the disk strip


def cell_token(text: str) -> str:
    """A token's text as a cell shows it: outer spaces off, a newline as ↵, nothing but spaces as ␣."""
    shown = text.replace("\n", "↵").replace("\t", "→").strip()
    return shown or ("␣" if text else "")


def full_precision_mask(record, layer: int) -> np.ndarray | None:
    """(max_pages, page_size) bool: slots of the layer still in full precision (int4 / int2), else None."""
    return None if record.full_precision is None else record.full_precision[layer]


def merge_segments(record, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """x, y of a line per merge this step (an eviction whose detail names the survivor's position): from the
    evicted token's cell centre to its survivor's, in pairs (PlotCurveItem connect='pairs'). Empty without."""
    slots, frame_of = record.slot_maps[layer], frames_of_pages(record, layer)
    xs, ys = [], []
    for event in in_layer(record.events, layer):
        if event.kind is not EventKind.EVICT or event.detail < 0 or frame_of.get(event.page, -1) < 0:
            continue
        target = np.argwhere(slots == event.detail)
        if len(target):
            xs += [event.slot + 0.5, target[0][1] + 0.5]
            ys += [frame_of[event.page] + 0.5, target[0][0] + 0.5]
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def shade_values(record, layer: int, mode: str) -> np.ndarray:
    """(max_pages, page_size) in [0, 1]: 1 = newest (age) or highest keep-score (score); NaN where empty."""
    slots = record.slot_maps[layer].astype(np.float64)
    resident = slots >= 0
    out = np.full(slots.shape, np.nan)
    if mode == "none" or not resident.any():
        out[resident] = 1.0
        return out
    values = slots if mode == "age" else record.scores[layer].astype(np.float64)
    finite = resident & np.isfinite(values)
    if finite.any():
        # by rank, so that a few outliers (sinks, heavy hitters) do not flatten everyone else
        ranked = values[finite]
        order = np.argsort(np.argsort(ranked, kind="stable"), kind="stable")
        out[finite] = order / max(ranked.size - 1, 1) if ranked.max() > ranked.min() else 1.0
    out[resident & ~finite] = 1.0
    return out


def disk_states(record, layer: int, n_pages: int) -> np.ndarray:
    """(n_pages,) int8 index into DISK_STATES for every page id of a tiered layer."""
    states = np.zeros(n_pages, dtype=np.int8)
    frames = frames_of_pages(record, layer)
    for page in record.block_tables[layer]:
        states[page] = 2 if page in frames else 1
    for event in in_layer(record.events, layer):
        if event.kind is EventKind.FAULT_IN and event.page < n_pages:
            states[event.page] = 3
        elif event.kind is EventKind.SWAP_OUT and event.page < n_pages:
            states[event.page] = 4
    return states


def layer_capacity(record, layer: int) -> int:
    """Tokens this layer may hold, as the record says: the pool, or less under a policy with per-layer budgets
    (pyramidkv, duo); a trace before version 5 does not say, so the pool's RAM slots."""
    if record.capacities is not None:
        return int(record.capacities[layer])
    return record.slot_maps[layer].size

"""Page grid: the physical pages × slots of one layer's KV cache at the selected step, and its block table."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import in_layer
from pagevis.kvcache.layer_spec import layer_specs
from pagevis.gui.widgets import theme
from pagevis.gui.widgets.block_table import MAX_TABLE_WIDTH, MIN_TABLE_WIDTH, PAGES_NOTE, BlockTable
from pagevis.gui.widgets.cell_labels import CellLabels
from pagevis.viewmodel.cells import (
    DISK_STATES, FREE, LEGEND_NOTE, PINNED, REPLACED, RESIDENT, SLID, STATE_COLORS, STATE_NAMES, WRITTEN,
    cell_states, disk_states, frames_of_pages, full_precision_mask, layer_capacity, legend_states, merge_segments,
    shade_values)
from pagevis.viewmodel.view_state import ViewState
from pagevis.gui.widgets.rgba_image import RgbaImage
from pagevis.viewmodel.run_list import run_list

_PALETTE = np.array([theme.rgb(c) for c in STATE_COLORS])
_BACKGROUND = theme.rgb(theme.BACKGROUND)
_CELL_PX = 12  # pixels per cell side in the rendered image (1 of them is the cell border)
_MAX_BORDERED_CELLS = 8192
WIDE_PAGE = 16  # pages of this many slots or more narrow the block table to MIN_TABLE_WIDTH
FULL_PRECISION_COLOR = "#f2d45c"  # the bar marking a slot still in float32 (int4 / int2's residual window)
_FULL_PRECISION = theme.rgb(FULL_PRECISION_COLOR)
DIM_FLOOR = 0.5  # the oldest (or lowest-scored) resident cell keeps this share of its state's colour: still the
# HTML page's blue, with its white number readable
MERGE_COLOR = "#5ce0f2"  # a line from an evicted cell to the survivor its value was merged into (policy merge)


def cell_image(states: np.ndarray, shade: np.ndarray, bordered: bool, full: np.ndarray | None = None) -> np.ndarray:
    """RGBA uint8 image of the grid: one colour per state, resident cells dimmed by shade; cells in `full`
    (still in full precision) get a bar along their bottom (bordered) or are tinted (not bordered)."""
    colors = _PALETTE[states]
    dim = np.isin(states, (RESIDENT, PINNED)) & np.isfinite(shade)
    strength = np.where(dim, DIM_FLOOR + (1 - DIM_FLOOR) * np.nan_to_num(shade, nan=1.0), 1.0)[..., None]
    colors = _BACKGROUND + (colors - _BACKGROUND) * strength
    rgba = np.empty(states.shape + (4,), dtype=np.uint8)
    rgba[..., :3] = np.clip(colors * 255, 0, 255)
    rgba[..., 3] = 255
    marked = full is not None and full.any()
    if not bordered:
        if marked:
            rgba[full, :3] = np.clip((0.5 * colors[full] + 0.5 * _FULL_PRECISION) * 255, 0, 255)
        return rgba
    big = np.repeat(np.repeat(rgba, _CELL_PX, axis=0), _CELL_PX, axis=1)
    if marked:  # a 3-pixel bar along the bottom of each full-precision cell
        bar = np.zeros(_CELL_PX, dtype=bool)
        bar[_CELL_PX - 4: _CELL_PX - 1] = True
        cells = np.repeat(np.repeat(full, _CELL_PX, axis=0), _CELL_PX, axis=1)
        big[cells & np.tile(bar, full.shape[0])[:, None]] = [*(_FULL_PRECISION * 255).astype(np.uint8), 255]
    big[_CELL_PX - 1:: _CELL_PX, :, :3] = (_BACKGROUND * 255).astype(np.uint8)
    big[:, _CELL_PX - 1:: _CELL_PX, :3] = (_BACKGROUND * 255).astype(np.uint8)
    return big


DISK_COLUMNS = 64  # the disk strip: one cell per disk page, rows of this many
DISK_COLORS = (STATE_COLORS[FREE], "#51606f", STATE_COLORS[RESIDENT], STATE_COLORS[WRITTEN],
               STATE_COLORS[REPLACED])


def disk_image(states: np.ndarray) -> np.ndarray:
    """RGBA rows of DISK_COLUMNS cells (2 px each, 1 px gap) for the disk strip."""
    rows = -(-len(states) // DISK_COLUMNS)
    padded = np.zeros(rows * DISK_COLUMNS, dtype=np.int8)
    padded[: len(states)] = states
    palette = np.array([theme.rgb(c) for c in DISK_COLORS])
    rgba = np.empty((rows, DISK_COLUMNS, 4), dtype=np.uint8)
    rgba[..., :3] = np.clip(palette[padded.reshape(rows, DISK_COLUMNS)] * 255, 0, 255)
    rgba[..., 3] = 255
    rgba.reshape(-1, 4)[len(states):, 3] = 0  # past the last page
    big = np.repeat(np.repeat(rgba, 4, axis=0), 4, axis=1)
    big[3::4, :, :3] = (_BACKGROUND * 255).astype(np.uint8)
    big[:, 3::4, :3] = (_BACKGROUND * 255).astype(np.uint8)
    return big


SLID_LOOKBACK = 512  # a layer's newest evictions and slides looked at for the pages that slid out


def slid_out_pages(state) -> list[int]:
    """On a sliding-window layer, the pages that slid out of the window up to the shown step and hold nothing
    since: the grid keeps them in the slid-out colour until the pool hands them out again (one step's colour
    alone was never seen: a page slides every page-size steps)."""
    timeline, record, layer = state.timeline, state.record, state.layer
    windows = timeline.info.sliding_windows if timeline is not None else None
    if record is None or windows is None or not windows[layer]:
        return []
    of_layer = timeline.evictions.of_layer(layer)
    until = of_layer.until(timeline.evictions_until(state.index))
    slid = {e.page for e in of_layer[max(0, until - SLID_LOOKBACK): until] if e.slot < 0}
    slots, table = record.slot_maps[layer], set(record.block_tables[layer])
    return sorted(page for page in slid if page not in table and 0 <= page < len(slots) and (slots[page] < 0).all())


def legend_html(hybrid: bool, note: bool = True) -> str:
    """The grid's colour legend in one line (wrapping between entries, never inside one, where the dock is
    narrow), in the HTML page's words; the slid-out state only for a hybrid cache (sliding-window layers).
    `note`: what the numbers are, after the colours (the presentation layout leaves it to the tooltip)."""
    swatches = [f"<span style='color:{STATE_COLORS[state]}'>&#9632;</span>&nbsp;"
                + STATE_NAMES[state].replace(" ", "&nbsp;") for state in legend_states(hybrid)]
    if note:
        swatches.append(f"<span style='color:{theme.MUTED}'>{LEGEND_NOTE.replace(' ', '&nbsp;')}</span>")
    return "&nbsp;&nbsp; ".join(swatches)


LEGEND_TOOLTIP = ("numbers: the token position each slot holds (and its text, where the cell has room); resident "
                  "cells dim with age or policy score (Controls ▸ Grid shading)")


def layer_label(info, layer: int) -> str:
    """'global' or 'local W=512': what a layer of the session's cache holds."""
    return layer_specs(info.sliding_windows, info.n_layers)[layer].label


def cell_ticks(n: int) -> list[list[tuple[float, str]]]:
    """Tick levels for n cells, labelled at their centres: every 8th cell, then the 4th, 2nd and each between
    (disjoint levels). pyqtgraph draws a finer level's labels only while they fit, so a narrow grid shows
    0, 8, 16 … instead of numbers running together."""
    levels, taken = [], set()
    for stride in (8, 4, 2, 1):
        level = [(i + 0.5, str(i)) for i in range(0, n, stride) if i not in taken]
        taken.update(range(0, n, stride))
        if level:
            levels.append(level)
    return levels


class PageGridView(QWidget):
    title = "Page grid"

    def __init__(self, parent=None):
        super().__init__(parent)
        self.states = np.zeros((0, 0), dtype=np.int8)  # what is drawn: theme state per (page, slot)
        self.shade = np.zeros((0, 0))
        self.full_precision: np.ndarray | None = None  # int4 / int2: slots still in float32 (drawn with a bar)
        self._state = ViewState()
        self._key = None
        self.presentation = False  # the presentation layout: no block table, bigger numbers and titles

        self.graphics = pg.GraphicsLayoutWidget()
        self.plot = self.graphics.addPlot()
        theme.style_plot(self.plot, left="page", bottom="slot")  # physical: the block table maps logical pages to these
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.showGrid(x=False, y=False)
        self.image = RgbaImage()
        self.labels = CellLabels()
        self.plot.addItem(self.image)
        # the cells' borders as 1-pixel lines at every page and slot boundary, drawn at the screen's scale: borders
        # inside the image, scaled down to 64 rows of ~5 px, came out as uneven bands of lines (Gemma's grid)
        self.borders = pg.PlotCurveItem(pen=pg.mkPen(theme.BACKGROUND, width=1), connect="pairs")
        self.plot.addItem(self.borders)
        self.plot.addItem(self.labels)
        self.merges = pg.PlotCurveItem(pen=pg.mkPen(MERGE_COLOR, width=2), connect="pairs")
        self.plot.addItem(self.merges)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        self.hover_text = ""
        self._held_texts: dict[bytes, tuple[int, str]] = {}  # a page's positions -> (tokens, run list)
        # the disk tier, one cell per page id, under the RAM frames (only with a disk tier)
        self.disk = self.graphics.addPlot(row=1, col=0)
        theme.style_plot(self.disk, left="disk", bottom="page id mod 64")
        self.disk.invertY(True)
        self.disk.setMenuEnabled(False)
        self.disk.hideButtons()
        self.disk.getAxis("left").setStyle(showValues=False)
        self.disk_image = RgbaImage()
        self.disk.addItem(self.disk_image)
        self.disk_states = np.zeros(0, dtype=np.int8)
        self.disk.hide()

        self.legend = QLabel(legend_html(hybrid=False))
        self.legend.setWordWrap(True)  # it may wrap (between entries) rather than hold the dock wider than its share
        self.legend.setToolTip(LEGEND_TOOLTIP)
        self.precision_legend = QLabel(
            f"<span style='color:{FULL_PRECISION_COLOR}'>&#9601;</span>&nbsp;still float32 (residual window)")
        self.precision_legend.setToolTip("int4 / int2 quantize a group of 32 tokens once it is older than the "
                                         "residual window; until then its slots stay in float32")
        self.precision_legend.setWordWrap(True)
        self.precision_legend.hide()

        self.disk_legend = QLabel("disk: " + "&nbsp;&nbsp; ".join(
            f"<span style='color:{c}'>&#9632;</span>&nbsp;{n.replace(' ', '&nbsp;')}"
            for n, c in zip(DISK_STATES, DISK_COLORS, strict=True)))
        self.disk_legend.setWordWrap(True)
        self.disk_legend.hide()
        self.blocks = BlockTable()
        self.block_view = self.blocks
        self.block_view.setMinimumWidth(MIN_TABLE_WIDTH)
        self.block_view.setMaximumWidth(MAX_TABLE_WIDTH)
        self.graphics.setMinimumWidth(250)  # the grid's title fits (a projector's 1280 × 720)
        self.block_title = block_title = QLabel("Block table (logical → physical)")
        block_title.setStyleSheet(f"color: {theme.MUTED}")
        block_title.setToolTip(PAGES_NOTE)

        left = QVBoxLayout()
        left.setContentsMargins(0, 0, 0, 0)
        left.addWidget(self.graphics, 1)
        left.addWidget(self.legend)
        left.addWidget(self.precision_legend)
        left.addWidget(self.disk_legend)
        right = QVBoxLayout()
        right.setContentsMargins(0, 0, 0, 0)
        right.addWidget(block_title)
        right.addWidget(self.block_view, 1)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(left, 1)
        layout.addLayout(right)
        self._table_narrow = False

    def _place_block_table(self, page_size: int) -> None:
        """Pages of 16 slots or more: the block table at its narrowest, leaving the grid the width to write
        its numbers (at 1600 × 1000 beside a full-width table, 16 columns were 14 px each). Its positions
        column then scrolls sideways for a long run list (the tooltip has it whole)."""
        narrow = page_size >= WIDE_PAGE
        if narrow == self._table_narrow:
            return
        self._table_narrow = narrow
        self.blocks.widest = MIN_TABLE_WIDTH if narrow else MAX_TABLE_WIDTH
        self.block_view.setMaximumWidth(self.blocks.widest)

    def set_presentation(self, on: bool) -> None:
        """The presentation layout's grid: the block table hidden (the cells' numbers say what each page
        holds), numbers and token texts up to a larger size, a larger title and legend."""
        self.presentation = on
        self.block_title.setVisible(not on)
        self.block_view.setVisible(not on)
        self.labels.max_pixel_size = 20 if on else 13
        self.legend.setStyleSheet("font-size: 13px;" if on else "")
        self._key = None  # the title's size changes
        self.labels.update()
        self.show_state(self._state)

    def _title_size(self) -> str:
        return "12pt" if self.presentation else "9pt"

    def _title(self, plot, text: str) -> None:
        theme.set_title(plot, theme.muted(text), size=self._title_size())

    def export_target(self):
        return self.graphics

    def show_state(self, state: ViewState) -> None:
        self._state = state
        record = state.record
        key = (id(record), id(state.timeline), state.loading, state.layer, state.shade)
        if key == self._key:
            return
        self._key = key
        if record is None:
            self._show_empty_pool(state)
            return
        layer = state.layer
        slots = record.slot_maps[layer]
        pages, page_size = slots.shape
        self._place_block_table(page_size)
        self.states = cell_states(record, layer)
        for page in slid_out_pages(state):  # a local layer's pages that left its window and hold nothing since
            self.states[page] = SLID
        self.shade = shade_values(record, layer, state.shade)
        self.full_precision = full_precision_mask(record, layer)
        bordered = self.states.size <= _MAX_BORDERED_CELLS and self.full_precision is not None
        self.image.set_image(cell_image(self.states, self.shade, bordered, self.full_precision), pages, page_size)
        self._draw_borders(pages, page_size)
        self.precision_legend.setVisible(self.full_precision is not None)
        self.labels.set_positions(slots if self.states.size <= 1024 else np.full((0, 0), -1, np.int32),
                                  state.timeline.position_text)
        self.merges.setData(*merge_segments(record, layer))
        self._fit_axes(pages, page_size)
        used = len(record.block_tables[layer])
        resident = int((slots >= 0).sum())
        capacity = layer_capacity(record, layer)
        own = f"holds at most {capacity}" if capacity < pages * page_size else ""
        parts = [f"layer {layer}", own, f"{used}/{pages} pages", f"{resident} tokens"]  # most telling first
        if record.tiers is not None:
            parts = [f"layer {layer}", f"RAM frames keep {len(frames_of_pages(record, layer))} of {used} pages"]
        if self.full_precision is not None:
            parts.append(f"{int(self.full_precision.sum())} float32")
        info = state.timeline.info
        parts += [clause.split(": ", 1)[0] for clause in info.storage_notice.split("; ") if "(ThinK)" in clause]
        hybrid = info.sliding_windows is not None
        if hybrid:
            parts[0] = f"layer {layer} ({layer_label(info, layer)})"
        self.legend.setText(legend_html(hybrid, note=not self.presentation))
        self._title(self.plot, theme.fit_parts(self.plot, parts, size=self._title_size()))
        table = f" · layer {layer}: {capacity} tokens" if own else ""
        self.block_title.setText(f"Block table (logical → physical){table}")
        self.blocks.set_rows(self.block_rows(record, layer))
        self._show_disk(record, layer)

    def block_rows(self, record, layer: int) -> list[tuple]:
        """(logical, where, tokens, positions) per page of the layer's block table; with a disk tier,
        where says the tier and frame, e.g. "RAM 3 · page 17" or "disk · page 17"."""
        slots = record.slot_maps[layer]
        if record.tiers is None:
            table = record.block_tables[layer]
            first = self._first_logical(layer, slots[table[0]] if len(table) else None)
            return [(first + i, page, *self._held(slots[page])) for i, page in enumerate(table)]
        page_map = record.page_map(layer) if layer in record.attention_layers else None
        rows = []
        for logical, (page, frame) in enumerate(zip(record.block_tables[layer], record.tiers.block_frames[layer],
                                                    strict=True)):
            where = f"RAM {frame} · page {page}" if frame >= 0 else f"disk · page {page}"
            source = page_map[page] if page_map is not None else slots[frame] if frame >= 0 else None
            if source is None:
                rows.append((logical, where, "?", "layer not recorded"))
                continue
            rows.append((logical, where, *self._held(source)))
        return rows

    def _first_logical(self, layer: int, first_page: np.ndarray | None) -> int:
        """The logical index of a table's first page: 0, or on a local layer (its older pages slid out) the page
        its oldest token falls in."""
        info = self._state.timeline.info if self._state.timeline is not None else None
        if first_page is None or info is None or info.sliding_windows is None or not info.sliding_windows[layer]:
            return 0
        held = first_page[first_page >= 0]
        return int(held.min()) // len(first_page) if held.size else 0

    def _held(self, page: np.ndarray) -> tuple[int, str]:
        """(tokens, run list) of a page's slot positions (-1: empty), kept by content: a step changes a page
        or two, so the others' texts are looked up, not rebuilt."""
        key = page.tobytes()
        found = self._held_texts.get(key)
        if found is None:
            if len(self._held_texts) >= 4096:
                self._held_texts.clear()
            held = page[page >= 0]
            found = self._held_texts[key] = (int(held.size), run_list(held))
        return found

    def _show_disk(self, record, layer: int) -> None:
        info = self._state.timeline.info if self._state.timeline is not None else None
        n_pages = info.config.disk_pages if info is not None else 0
        if record.tiers is None or not n_pages:
            self.disk.hide()
            self.disk_legend.hide()
            self.disk_states = np.zeros(0, dtype=np.int8)
            return
        self.disk.show()
        self.disk_legend.show()
        self.disk_states = disk_states(record, layer, n_pages)
        rows = -(-n_pages // DISK_COLUMNS)
        self.disk_image.set_image(disk_image(self.disk_states), rows, DISK_COLUMNS)
        self.disk.setRange(xRange=(0, DISK_COLUMNS), yRange=(0, rows), padding=0.02)
        counts = record.tiers.counts[layer]
        faults, swapped = int(counts[1]), int(counts[2])
        self.graphics.ci.layout.setRowStretchFactor(0, 4)
        self.graphics.ci.layout.setRowStretchFactor(1, 1)
        theme.set_title(self.disk, theme.muted(f"disk: {n_pages} pages · {faults} read, {swapped} swapped out"),
                        size="9pt")

    def disk_info(self, page: int) -> str:
        """The hover text of one disk page."""
        record, layer = self._state.record, self._state.layer
        if record is None or not 0 <= page < len(self.disk_states):
            return ""
        lines = [f"disk page {page}: {DISK_STATES[self.disk_states[page]]}"]
        if page in record.block_tables[layer]:
            if layer in record.attention_layers:
                held = record.page_map(layer)[page]
                held = held[held >= 0]
                lines.append(f"holds {held.size} tokens: positions {run_list(held, max_runs=6)}")
            else:
                lines.append("(its tokens are kept for recorded layers only: --record-layers)")
            frame = frames_of_pages(record, layer).get(page)
            if frame is not None:
                lines.append(f"cached in RAM frame {frame}")
        for event in in_layer(record.events, layer):
            if event.page == page and event.kind in (EventKind.FAULT_IN, EventKind.SWAP_OUT):
                lines.append(f"{event.kind.value} (RAM frame {event.frame}): {event.reason}")
        return "\n".join(lines)

    def _show_empty_pool(self, state: ViewState) -> None:
        """Before the first step (or while the model loads): the session's pool, every page free."""
        self.labels.set_positions(np.zeros((0, 0), dtype=np.int32))
        self.merges.setData([], [])
        self.blocks.set_rows([])
        info = state.timeline.info if state.timeline is not None else None  # (a model loading: not hybrid yet)
        hybrid = info is not None and info.sliding_windows is not None
        self.legend.setText(legend_html(hybrid, note=not self.presentation))  # not the last session's
        config = state.config
        if config is None:
            self.states = np.zeros((0, 0), dtype=np.int8)
            self.image.clear()
            self._fit_axes(1, 1)
            self._title(self.plot, "no session")
            return
        pages, page_size = config.max_pages, config.page_size
        self._place_block_table(page_size)
        self.full_precision = None
        self.precision_legend.hide()
        self.states = np.full((pages, page_size), FREE, dtype=np.int8)
        self.shade = np.full(self.states.shape, np.nan)
        self.image.set_image(cell_image(self.states, self.shade, False), pages, page_size)
        self._draw_borders(pages, page_size)
        self._fit_axes(pages, page_size)
        self._title(self.plot, f"{pages} pages × {page_size} slots, all free")

    def _draw_borders(self, pages: int, page_size: int) -> None:
        """A line between every two pages and every two slots (none over a grid too large for borders)."""
        if getattr(self, "_borders", None) == (pages, page_size):
            return
        self._borders = (pages, page_size)
        if pages * page_size > _MAX_BORDERED_CELLS:
            self.borders.setData([], [])
            return
        rows, columns = np.arange(1, pages, dtype=float), np.arange(1, page_size, dtype=float)
        x = np.concatenate([np.tile([0.0, page_size], len(rows)), np.repeat(columns, 2)])
        y = np.concatenate([np.repeat(rows, 2), np.tile([0.0, pages], len(columns))])
        self.borders.setData(x, y, connect="pairs")

    def _fit_axes(self, pages: int, page_size: int) -> None:
        if getattr(self, "_shape", None) == (pages, page_size):
            return
        self._shape = (pages, page_size)
        self.plot.setRange(xRange=(0, page_size), yRange=(0, pages), padding=0.02)
        self.plot.getAxis("left").setTicks(cell_ticks(pages) if pages <= 64 else None)
        self.plot.getAxis("bottom").setTicks(cell_ticks(page_size) if page_size <= 64 else None)

    def cell_info(self, page: int, slot: int) -> str:
        """The hover text of one cell."""
        state, record = self._state, self._state.record
        if not (0 <= page < self.states.shape[0] and 0 <= slot < self.states.shape[1]):
            return ""
        if record is None:
            return f"page {page}, slot {slot}: free"
        position = int(record.slot_maps[state.layer][page, slot])
        lines = [f"page {page}, slot {slot}: {STATE_NAMES[self.states[page, slot]]}"]
        if position >= 0:
            token = state.timeline.position_text(position)
            lines.append(f"position {position}: {token!r}")
            score = float(record.scores[state.layer][page, slot])
            lines.append(f"policy score: {score:.4g}")
            if self.full_precision is not None:
                dtype = state.timeline.info.config.dtype
                lines.append("in float32 (the residual window)" if self.full_precision[page, slot]
                             else f"quantized ({dtype})")
        frame_of = frames_of_pages(record, state.layer)
        for event in in_layer(record.events, state.layer):
            if event.kind is EventKind.SLIDE and event.page == page and record.tiers is None:
                lines.append(f"page {page} slid out of the window this step (its newest position {event.position}: "
                             f"the newest query sees none of its tokens)")
            if frame_of.get(event.page, -1) == page and event.slot == slot and \
                    event.kind is EventKind.EVICT:
                lines.append(f"evicted position {event.position} "
                             f"({state.timeline.position_text(event.position)!r}): {event.reason}"
                             + (f" into position {event.detail}" if event.detail >= 0 else ""))
        return "\n".join(lines)

    def _hover(self, scene_pos: QPointF) -> None:
        if self.disk.isVisible() and self.disk.sceneBoundingRect().contains(scene_pos):
            point = self.disk.vb.mapSceneToView(scene_pos)
            row, column = int(np.floor(point.y())), int(np.floor(point.x()))
            text = self.disk_info(row * DISK_COLUMNS + column) if 0 <= column < DISK_COLUMNS else ""
        elif not self.plot.sceneBoundingRect().contains(scene_pos) or not self.states.size:
            return
        else:
            point = self.plot.vb.mapSceneToView(scene_pos)
            page, slot = int(np.floor(point.y())), int(np.floor(point.x()))
            text = self.cell_info(page, slot)
        if text != self.hover_text:
            self.hover_text = text
            view_pos = self.graphics.mapFromScene(scene_pos)
            QToolTip.showText(self.graphics.mapToGlobal(view_pos), text, self.graphics)

"""The GUI's model: every StepRecord of one session (live or replayed) and what views derive from them.

Qt-free. The worker thread never touches a Timeline; records reach it through `extend()` on the UI thread.

Memory is bounded per step, whatever the cache size: records go to a RecordSpill (an anonymous temporary
file) as they arrive and only the newest KEEP stay whole in memory; a view asking for an older one gets it
rebuilt from the file (one read, ~0.2 ms), and the last few rebuilt are cached. What stays in memory per
step is what the plots and tables read for every step at once, as NumPy columns: the series, evictions per
layer, the evictions themselves (~30 bytes each) and the file offsets — about 1 KB per step for SmolLM2
(30 layers, ~30 evictions a step), against ~60-200 KB for whole records.

The attention heatmap shows at most HEATMAP_ROWS steps (ending at the selected one) by HEATMAP_COLUMNS
positions (ending at the newest written), built from per-layer rows read from the file and cached, so a
scrub or a layer switch costs the same at step 100 and at step 50 000.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from pagevis.engine import SessionConfig, StepRecord
from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import KINDS
from pagevis.viewmodel.spill import RecordSpill, _grow

KEEP = 8  # newest records kept whole in memory
REBUILT = 16  # older records rebuilt from the spill file and kept, least recently used first out
HEATMAP_ROWS = 192  # steps the attention heatmap shows, ending at the selected step
HEATMAP_COLUMNS = 768  # positions it shows, ending at the newest written by then
ROW_CACHE_LAYERS = 3  # layers whose heatmap rows stay cached (the shown one, and the ones just before)


class Eviction(NamedTuple):
    step: int
    layer: int
    page: int
    slot: int
    position: int
    token: str
    reason: str
    score: float


EVICT = KINDS.index(EventKind.EVICT)
SLIDE = KINDS.index(EventKind.SLIDE)  # a page leaving a sliding window: listed with the evictions, not counted
EVICTION_DTYPE = np.dtype([("step", "i4"), ("layer", "i2"), ("page", "i4"), ("slot", "i4"), ("position", "i8"),
                           ("reason", "i2"), ("score", "f4")])


@dataclass(frozen=True)
class SessionInfo:
    """What a view needs to know about the session besides its records."""

    model_label: str
    prompt: str
    prompt_ids: tuple[int, ...]
    config: SessionConfig
    n_layers: int
    n_heads: int
    cache_bytes: int = 0
    n_kv_heads: int = 0  # 0: unknown (a trace without it); query head h reads KV head h // (n_heads // n_kv_heads)
    kv_bytes_per_token: float = 0.0  # all layers, at capacity (CacheConfig.kv_bytes_per_token); 0: unknown
    storage: str = ""  # one line on the K/V storage (quant.storage_text); "": unknown
    sliding_windows: tuple[int | None, ...] | None = None  # per layer, a hybrid cache's windows (None: all global)
    page_bytes: int = 0  # K/V bytes of one page of one layer; 0: unknown
    storage_notice: str = ""  # quant.storage_notice: the residual window clamped, bytes beyond float32's


def kv_head_of(head: int, n_heads: int, n_kv_heads: int) -> int | None:
    """The KV head query head `head` reads (grouped-query attention), or None when the layout is unknown."""
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        return None
    return head // (n_heads // n_kv_heads)


def head_label(head: int, n_heads: int, n_kv_heads: int) -> str:
    kv = kv_head_of(head, n_heads, n_kv_heads)
    return f"head {head}" if kv is None else f"head {head} (KV {kv})"


class Timeline:
    def __init__(self, info: SessionInfo, token_text: Callable[[int], str]):
        self.info = info
        self._token_text = token_text
        self._texts: dict[int, str] = {}
        self.spill = RecordSpill()
        self._count = 0
        self._recent: dict[int, StepRecord] = {}
        self._rebuilt: OrderedDict[int, StepRecord] = OrderedDict()
        self.records = _Records(self)
        self._token_ids = np.zeros(0, dtype=np.int64)  # token id at each position that has entered the cache
        self._n_positions = 0
        self._written = np.zeros(0, dtype=np.int64)  # per record: positions written so far
        self._evictions = np.zeros(0, dtype=EVICTION_DTYPE)
        self._n_evictions = 0
        self.evictions = _Evictions(self)
        self._per_layer = np.zeros((0, info.n_layers), dtype=np.int32)  # evictions per (record, layer)
        self._slid: np.ndarray | None = None  # tokens slid out of a window per (record, layer), from the first slide
        self._pages = np.zeros((0, info.n_layers), dtype=np.int32)  # pages in use per (record, layer)
        self._series = np.zeros((0, len(SERIES)), dtype=np.float64)
        self._columns_cache = (np.zeros((3, 0)), 0)
        self._rows: OrderedDict[int, OrderedDict[int, tuple]] = OrderedDict()  # heatmap rows by layer, step
        # the last heatmap window (see _window): layer, head, first step, positions, weights
        self._heat: tuple[int, int | None, int, np.ndarray, np.ndarray] | None = None

    # --- growth ----------------------------------------------------------------------------------
    def extend(self, records: list[StepRecord]) -> None:
        for record in records:
            self._append(record)

    def _append(self, record: StepRecord) -> None:
        index = self._count
        for token, position in zip(record.token_ids, record.positions):
            if position >= len(self._token_ids):
                grown = np.full(max(2 * len(self._token_ids), position + 1, 64), -1, dtype=np.int64)
                grown[: len(self._token_ids)] = self._token_ids
                self._token_ids = grown
            self._token_ids[position] = token
            self._n_positions = max(self._n_positions, position + 1)
        self._written = _grow(self._written, index)
        self._written[index] = self._n_positions
        self._per_layer = _grow(self._per_layer, index)
        self._per_layer[index] = 0
        if self._slid is not None:
            self._slid = _grow(self._slid, index)
            self._slid[index] = 0
        self._pages = _grow(self._pages, index)
        self._pages[index] = [len(table) for table in record.block_tables]
        rows = self.spill.append(record)  # the events as rows, texts coded in the spill's table
        evicted = rows[(rows["kind"] == EVICT) | (rows["kind"] == SLIDE)]
        if len(evicted):
            start, end = self._n_evictions, self._n_evictions + len(evicted)
            self._evictions = _grow(self._evictions, end - 1)
            added = self._evictions[start:end]
            # the record's index, not the event's step: events carry the engine's step count, which a
            # restart in place (the app's Reset) carries on while the new timeline counts from 0 again
            added["step"] = index
            for name in ("layer", "page", "slot", "position", "reason", "score"):
                added[name] = evicted[name]
            is_evict = evicted["kind"] == EVICT
            np.add.at(self._per_layer[index], evicted["layer"][is_evict], 1)
            if not is_evict.all():
                if self._slid is None:
                    self._slid = np.zeros(self._per_layer.shape, dtype=np.int32)
                np.add.at(self._slid[index], evicted["layer"][~is_evict], evicted["detail"][~is_evict])
            self._n_evictions = end
        total = record.timings.get("total", float("nan"))
        oracle = record.oracle
        n_tokens = len(record.token_ids)
        self._series = _grow(self._series, index)
        self._series[index] = (
            n_tokens, record.resident_tokens, record.pages_used, total * 1e3,
            n_tokens / total if total > 0 else float("nan"),
            oracle.kl if oracle else float("nan"), float(oracle.top1_agree) if oracle else float("nan"),
            oracle.lost_attention if oracle else float("nan"), *_tier_series(record))
        self._recent[index] = record
        self._recent.pop(index - KEEP, None)
        self._count += 1

    # --- records ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def record(self, index: int) -> StepRecord:
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"record {index} of {self._count}")
        record = self._recent.get(index)
        if record is None:
            record = self._rebuilt.pop(index, None) or self.spill.record(index, self.token_text)
            self._rebuilt[index] = record
            while len(self._rebuilt) > REBUILT:
                self._rebuilt.popitem(last=False)
        return record

    def memory_bytes(self) -> int:
        """What this timeline holds in memory (the spill file's pages are the OS's, not counted)."""
        arrays = (self._token_ids, self._written, self._evictions, self._per_layer, self._pages, self._series,
                  *(() if self._slid is None else (self._slid,)))
        rows = sum(p.nbytes + (w.nbytes if w is not None else 0)
                   for layer in self._rows.values() for p, w in layer.values())
        whole = sum(_record_bytes(r) for r in (*self._recent.values(), *self._rebuilt.values()))
        heat = self._heat[3].nbytes + self._heat[4].nbytes if self._heat is not None else 0
        return sum(a.nbytes for a in arrays) + self.spill.memory_bytes() + rows + whole + heat

    # --- queries ---------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id) if token_id >= 0 else ""
        return text

    def position_text(self, position: int) -> str:
        if 0 <= position < self._n_positions:
            return self.token_text(int(self._token_ids[position]))
        return ""

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids[: self._n_positions]

    @property
    def written_upto(self) -> np.ndarray:
        """Per record: the number of positions written up to and including it."""
        return self._written[: self._count]

    def n_positions(self, index: int) -> int:
        """Positions written up to and including record `index`."""
        return int(self._written[index]) if self._count else 0

    def evictions_until(self, index: int) -> int:
        """How many evictions (all layers) happened in records 0..index."""
        if not self._count:
            return 0
        steps = self._evictions["step"][: self._n_evictions]
        return int(np.searchsorted(steps, index, side="right"))

    def eviction_steps(self) -> np.ndarray:
        """The records in which at least one eviction happened (any layer), in order."""
        return np.flatnonzero(self._per_layer[: self._count].any(axis=1))

    def eviction_columns(self) -> np.ndarray:
        """(3, evictions) float64: the step, layer and position of every eviction so far, in order."""
        columns, count = self._columns_cache
        if count != self._n_evictions:
            e = self._evictions[: self._n_evictions]
            columns = np.stack([e["step"], e["layer"], e["position"]]).astype(np.float64)
            self._columns_cache = (columns, self._n_evictions)
        return columns

    def series(self, name: str, upto: int | None = None) -> np.ndarray:
        column = self._series[: self._count, SERIES.index(name)]
        return column.copy() if upto is None else column[: upto + 1].copy()

    def evictions_per_step(self, layer: int | None = None) -> np.ndarray:
        counts = self._per_layer[: self._count]
        return counts.sum(axis=1) if layer is None else counts[:, layer].copy()

    def resident_per_step(self, layer: int) -> np.ndarray:
        """Tokens resident in `layer` after each record: positions written minus those it evicted or slid out."""
        left = self._per_layer[: self._count, layer]
        if self._slid is not None:
            left = left + self._slid[: self._count, layer]
        evicted = np.cumsum(left)
        return (self._written[: self._count] - evicted).astype(np.float64)

    def pages_per_step(self, layer: int) -> np.ndarray:
        """Pages in `layer`'s block table after each record."""
        return self._pages[: self._count, layer].astype(np.float64)

    def tokens_per_second(self, index: int, window: int = 16) -> float:
        """Decode speed over the last `window` decode steps up to `index` (forward + sampling time)."""
        low = max(0, index + 1 - window)
        decode = self.spill.column("kind")[low: index + 1] == 1
        times = self._series[low: index + 1, SERIES.index("latency_ms")][decode] / 1e3
        return len(times) / times.sum() if times.size and times.sum() > 0 else float("nan")

    # --- the attention heatmap -------------------------------------------------------------------
    def attention(self, layer: int, head: int | None, index: int, max_rows: int | None = None,
                  max_columns: int | None = None):
        """The heatmap window ending at record `index`: (weights, evicted, first_step, first_position), where
        weights is (steps, positions) float32, the attention of each step's last query by token position
        (head `head`, or the mean of heads), and evicted is True where that position had been evicted by
        then. Steps are first_step..index (at most `max_rows`, default HEATMAP_ROWS), positions
        first_position.. (at most `max_columns`, default HEATMAP_COLUMNS, ending at the last position
        written by `index`)."""
        first = max(0, index + 1 - (max_rows or HEATMAP_ROWS))
        n = self.n_positions(index)
        low = max(0, n - (max_columns or HEATMAP_COLUMNS))
        positions, by_slot = self._window(layer, head, first, index)
        count = index + 1 - first
        matrix = np.zeros((count, n - low), dtype=np.float32)
        resident = np.zeros((count, n - low), dtype=bool)
        keep = (positions >= low) & (positions < n)
        row_index = np.nonzero(keep)[0]
        columns = positions[keep] - low
        matrix[row_index, columns] = by_slot[keep]
        resident[row_index, columns] = True
        written = self._written[first: index + 1] - low
        evicted = ~resident & (np.arange(n - low)[None, :] < written[:, None])
        return matrix, evicted, first, low

    def _window(self, layer: int, head: int | None, first: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps first..index of one layer: each slot's position (steps, slots) int32 and its attention
        (steps, slots) float32, of head `head` or the mean of heads. The last window is kept (HEATMAP_ROWS x
        slots x 8 bytes at most), so following the newest step reduces one new row, not every row again."""
        kept = self._heat
        positions: np.ndarray | None
        weights: np.ndarray | None
        if kept is not None and kept[:2] == (layer, head) and kept[2] <= first <= kept[2] + len(kept[3]):
            start, positions, weights = kept[2:]
            positions = positions[first - start: index + 1 - start]
            weights = weights[first - start: index + 1 - start]
        else:
            positions = weights = None
        begin = first + (len(positions) if positions is not None else 0)
        if begin <= index:
            new = [self._layer_row(layer, step) for step in range(begin, index + 1)]
            new_positions = np.stack([p for p, _ in new])
            new_weights = np.stack([np.zeros(p.shape, np.float32) if w is None else
                                    w.mean(axis=0, dtype=np.float32) if head is None else w[head].astype(np.float32)
                                    for p, w in new])
            if positions is None or not len(positions):
                positions, weights = new_positions, new_weights
            else:
                positions = np.concatenate([positions, new_positions])
                weights = np.concatenate([weights, new_weights])
        assert positions is not None and weights is not None  # (begin <= index: first <= index)
        self._heat = (layer, head, first, positions, weights)
        return positions, weights

    def _layer_row(self, layer: int, step: int) -> tuple:
        rows = self._rows.get(layer)
        if rows is None:
            rows = self._rows[layer] = OrderedDict()
            while len(self._rows) > ROW_CACHE_LAYERS:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(layer)
        row = rows.get(step)
        if row is None:
            recent = self._recent.get(step)
            if recent is not None:
                flat = recent.page_map(layer).ravel()
                weights = (recent.attention[recent.attention_layers.index(layer)]
                           if layer in recent.attention_layers else None)
                row = (flat.astype(np.int32), None if weights is None else weights.astype(np.float16))
            else:
                row = self.spill.layer_row(step, layer)
            rows[step] = row
            while len(rows) > 2 * HEATMAP_ROWS:
                rows.popitem(last=False)
        return row


def _trace_kv_heads(trace) -> int:
    """KV heads of the traced model when an older trace says (a synthetic spec does), else 0 (unknown)."""
    spec = trace.model_spec
    return spec.n_kv_heads if spec is not None and spec.kind == "synthetic" else 0


def kv_layout(info: SessionInfo) -> dict:
    """The session's head layout and cache size as a trace carries them (pagevis.trace's kv_layout header)."""
    return {"n_heads": info.n_heads, "n_kv_heads": info.n_kv_heads, "cache_bytes": info.cache_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token, "storage": info.storage} if info.n_kv_heads else {}


def timeline_from_trace(trace) -> Timeline:
    """The timeline a replay shows: a trace's records (a pagevis.trace.Trace, which this package may not import),
    with its own token texts and, when the trace carries it (kv_layout, since format 4's later files), the model's
    head layout and the cache's size."""
    texts = dict(trace.token_texts)
    first = trace.records[0] if trace.records else None
    n_layers = first.slot_maps.shape[0] if first is not None else 1
    spec = trace.model_spec
    layout = trace.kv_layout or {}
    n_heads = first.attention[0].shape[0] if first is not None and first.attention else layout.get("n_heads", 1)
    n_kv_heads = layout.get("n_kv_heads", _trace_kv_heads(trace))
    if n_kv_heads and n_heads % n_kv_heads:  # a layout that does not fit the recorded heads: unknown
        n_kv_heads = 0
    info = SessionInfo(f"{trace.model_label} (trace)", trace.prompt, tuple(trace.prompt_ids), trace.config,
                       n_layers, n_heads, layout.get("cache_bytes", 0), n_kv_heads,
                       layout.get("kv_bytes_per_token", 0.0), layout.get("storage", ""),
                       sliding_windows=spec.sliding_windows if spec is not None else None)
    timeline = Timeline(info, lambda token: texts.get(token, f"<{token}>"))
    timeline.extend(list(trace.records))
    return timeline


SERIES = ("tokens", "resident_tokens", "pages_used", "latency_ms", "tokens_per_s", "kl", "top1_agree", "lost_attention",
          "faults", "mb_read", "hit_rate")  # the last three: disk tier, all layers (NaN without one)


def _tier_series(record: StepRecord) -> tuple[float, float, float]:
    """Pages read from disk, MB read and RAM hit rate of a step, over all layers."""
    if record.tiers is None:
        return (float("nan"),) * 3
    return (float(record.tiers.count("faults").sum()), record.tiers.count("bytes_read").sum() / 1e6,
            record.tiers.hit_rate())


def _record_bytes(record: StepRecord) -> int:
    arrays = (record.slot_maps, record.protected, record.scores, *record.attention)
    return sum(a.nbytes for a in arrays) + 100 * len(record.events)


class _Records:
    """The timeline's records as a read-only sequence (old ones are rebuilt from the spill file)."""

    def __init__(self, timeline: Timeline):
        self._timeline = timeline

    def __len__(self) -> int:
        return len(self._timeline)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._timeline.record(i) for i in range(*index.indices(len(self)))]
        return self._timeline.record(index)

    def __iter__(self):
        return (self._timeline.record(i) for i in range(len(self)))

    def __bool__(self) -> bool:
        return len(self) > 0


class _Evictions:
    """Every eviction so far as a read-only sequence of Eviction tuples, made on demand from NumPy columns."""

    def __init__(self, timeline: Timeline):
        self._timeline = timeline

    def __len__(self) -> int:
        return self._timeline._n_evictions

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            t = self._timeline
            text, reasons = t.position_text, t.spill.strings.texts
            return [Eviction(step, layer, page, slot, position, text(position), reasons[reason], score)
                    for step, layer, page, slot, position, reason, score in t._evictions[start:stop:stride].tolist()]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        t = self._timeline
        e = t._evictions[index]
        return Eviction(int(e["step"]), int(e["layer"]), int(e["page"]), int(e["slot"]), int(e["position"]),
                        t.position_text(int(e["position"])), t.spill.strings.texts[e["reason"]], float(e["score"]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def of_layer(self, layer: int) -> _LayerEvictions:
        return _LayerEvictions(self, layer)


class _LayerEvictions:
    """One layer's evictions so far, in order, as a read-only sequence: the events table's "selected layer only"
    takes its newest rows from these (the newest rows of every layer, then filtered, left a few of one layer)."""

    def __init__(self, evictions: _Evictions, layer: int):
        self._all, self.layer = evictions, layer
        self._index = np.zeros(0, dtype=np.int64)  # the layer's evictions' indexes among all
        self._seen = 0  # evictions (all layers) looked at so far

    def indexes(self) -> np.ndarray:
        t = self._all._timeline
        if self._seen != t._n_evictions:
            layers = t._evictions["layer"][self._seen: t._n_evictions]
            self._index = np.concatenate([self._index, np.flatnonzero(layers == self.layer) + self._seen])
            self._seen = t._n_evictions
        return self._index

    def until(self, limit: int) -> int:
        """How many of the layer's evictions are among the first `limit` of all layers."""
        return int(np.searchsorted(self.indexes(), limit))

    def __len__(self) -> int:
        return len(self.indexes())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._all[int(i)] for i in self.indexes()[index]]
        return self._all[int(self.indexes()[index])]

"""A timeline's StepRecords on disk: written once as they arrive, read back a record (or one layer of one
record) at a time. Qt-free.

Why: a record holds every layer's slot map, protected flags, scores and block table plus the recorded
layers' attention (about 60 KB for SmolLM2 with 96 slots, 200 KB with 256), so keeping them all would make
a long demo gigabytes. Here they go to an anonymous temporary file (deleted when closed or when the
process ends) with plain `os.pwrite`/`os.pread`: the file's pages live in the OS page cache, not in this
process's memory, and the only per-record memory is its start and one row of part offsets (~70 bytes).

Layout of a record: its parts one after the other, each a C-contiguous array's raw bytes; the offsets of the
parts are kept in memory, the shapes follow from the timeline's fixed geometry. The parts are the record's
custom fields' (CUSTOM_PARTS, written and read here) and then one per grid or layers field of the record's
field table (engine/step_record.py FIELDS: bool arrays bit-packed, an optional field's None as an empty part);
its scalar fields are columns of the small table. A new scalar, layers or grid field needs nothing here.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from pagevis.engine import OracleStep, StepRecord, TierStep, step_record
from pagevis.kvcache.event_array import EVENT_DTYPE, EventArray, Strings, to_rows

# The record's custom fields (step_record.FIELDS), each written and read by this module's own code.
CUSTOM_FIELDS = ("kind", "token_ids", "positions", "next_text", "block_tables", "events", "attention_layers",
                 "attention", "timings", "oracle", "tiers")
CUSTOM_PARTS = ("token_ids", "positions", "block_tables", "events", "attention_layers", "attention", "tier_counts",
                "page_maps", "block_frames", "recall")  # the last four: empty without tiers
# "recall" holds the oracle's float32 rows: the tier recall (n_layers, with tiers and the oracle), then its lost
# attention per recorded layer and head (with the oracle): one part, so a record's row of offsets stays as small
# The small table's columns of the custom fields (kind, the oracle's numbers); the scalar fields' follow.
CUSTOM_SMALL = [("kind", "i1"), ("has_oracle", "?"), ("kl", "f8"), ("top1", "?"), ("lp_bounded", "f8"),
                ("lp_full", "f8"), ("lost", "f8")]
TIMINGS = ("forward", "sample", "oracle", "record", "total")
RECORD_KINDS = ("prefill", "decode")


class RecordSpill:
    """Append-only store of one timeline's records. Geometry (layers, pages, page size, heads) is taken from
    the first record; every later record of a session has the same."""

    def __init__(self):
        table = step_record.TABLE  # read now: a test may give the spill a table with one more field
        self._record_type = table.record
        self._grids, self._scalars = table.of("grid", "layers"), table.of("scalar")
        self.parts = CUSTOM_PARTS + tuple(f.name for f in self._grids)
        self._file = tempfile.TemporaryFile(prefix="pagevis-timeline-")
        self._fd = self._file.fileno()
        self._end = 0
        self._starts = np.zeros(0, dtype=np.int64)  # per record: where it begins in the file
        self._cuts = np.zeros((0, len(self.parts) + 1), dtype=np.uint32)  # and where its parts begin in it
        self._small = np.zeros(0, dtype=CUSTOM_SMALL + [(f.name, f.dtype) for f in self._scalars])
        self._timings = np.zeros((0, len(TIMINGS)), dtype=np.float64)
        self.strings = Strings()  # the policy names and reasons events carry, interned
        self.count = 0
        self.shape: tuple[int, int, int] | None = None  # (layers, pages, page_size)
        self.n_heads = 0

    def close(self) -> None:
        self._file.close()

    @property
    def disk_bytes(self) -> int:
        return self._end

    def memory_bytes(self) -> int:
        return self._starts.nbytes + self._cuts.nbytes + self._small.nbytes + self._timings.nbytes

    # --- writing ---------------------------------------------------------------------------------
    def append(self, record: StepRecord) -> np.ndarray:
        """Write the record; return its events as the rows written (texts coded in `strings`)."""
        if self.shape is None:
            self.shape = record.slot_maps.shape
            self.n_heads = record.attention[0].shape[0] if record.attention else 0
        layers, pages, _ = self.shape
        width = max([pages, *(len(t) for t in record.block_tables)])  # page ids outnumber RAM frames with tiers
        tables = np.full((layers, width), -1, dtype=np.int32)
        for layer, table in enumerate(record.block_tables):
            tables[layer, : len(table)] = table
        events = to_rows(record.events, self.strings)
        attention = (np.stack(record.attention).astype(np.float16, copy=False) if record.attention
                     else np.zeros((0,), np.float16))
        tiers = record.tiers
        frames = np.full(tables.shape, -1, dtype=np.int32)
        for layer, row in enumerate(tiers.block_frames if tiers else ()):
            frames[layer, : len(row)] = row
        nothing = np.zeros(0, np.int32)
        parts = (np.asarray(record.token_ids, np.int64), np.asarray(record.positions, np.int64), tables, events,
                 np.asarray(record.attention_layers, np.int16), attention,
                 np.ascontiguousarray(tiers.counts, np.int64) if tiers else np.zeros(0, np.int64),
                 np.ascontiguousarray(tiers.page_maps, np.int32) if tiers else nothing,
                 frames if tiers else nothing,
                 _oracle_floats(record),
                 *(_grid_bytes(getattr(record, f.name), f.dtype) for f in self._grids))
        blob = b"".join(np.ascontiguousarray(p).data.cast("B") for p in parts)
        if len(blob) >= 1 << 32:
            raise ValueError(f"a record of {len(blob)} bytes is too large for the timeline's spill (4 GiB)")
        os.pwrite(self._fd, blob, self._end)
        self._starts, self._cuts = _grow(self._starts, self.count), _grow(self._cuts, self.count)
        self._starts[self.count] = self._end
        self._cuts[self.count] = np.cumsum([0] + [p.nbytes for p in parts])
        self._end += len(blob)
        o = record.oracle
        small = (RECORD_KINDS.index(record.kind), o is not None, o.kl if o else np.nan,
                 bool(o.top1_agree) if o else False, o.logprob_bounded if o else np.nan,
                 o.logprob_full if o else np.nan, o.lost_attention if o else np.nan,
                 *(getattr(record, f.name) for f in self._scalars))
        self._small = _grow(self._small, self.count)
        self._small[self.count] = small
        self._timings = _grow(self._timings, self.count)
        self._timings[self.count] = [record.timings.get(name, np.nan) for name in TIMINGS]
        self.count += 1
        return events

    # --- reading ---------------------------------------------------------------------------------
    def _part(self, index: int, name: str, dtype, start: int = 0, count: int | None = None) -> np.ndarray:
        """Part `name` of record `index` (or `count` items of it from item `start`)."""
        part = self.parts.index(name)
        begin = int(self._starts[index]) + int(self._cuts[index, part])
        end = int(self._starts[index]) + int(self._cuts[index, part + 1])
        itemsize = np.dtype(dtype).itemsize
        begin += start * itemsize
        if count is not None:
            end = begin + count * itemsize
        data = os.pread(self._fd, int(end - begin), int(begin))
        return np.frombuffer(data, dtype=dtype)

    def _grid_shape(self) -> tuple[int, int, int]:
        """(layers, pages, page_size) of the records' grids (set by the first append)."""
        if self.shape is None:
            raise IndexError("the spill holds no record yet")
        return self.shape

    def layer_row(self, index: int, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One layer of record `index`: its flat slot positions (slots,) int32 and attention (heads, slots)
        float16 (None if that layer's attention was not recorded). Two small reads."""
        _, pages, page_size = self._grid_shape()
        slots = pages * page_size
        layers = self._part(index, "attention_layers", np.int16).tolist()
        if layer not in layers:
            return self._part(index, "slot_maps", np.int32, layer * slots, slots), None
        maps = self._part(index, "page_maps", np.int32)
        if maps.size:  # a disk tier: attention covers every page id, not only the RAM frames
            slots = maps.size // len(layers)
            positions = maps[layers.index(layer) * slots: (layers.index(layer) + 1) * slots]
        else:
            positions = self._part(index, "slot_maps", np.int32, layer * slots, slots)
        heads = self.n_heads
        weights = self._part(index, "attention", np.float16, layers.index(layer) * heads * slots, heads * slots)
        return positions, weights.reshape(heads, slots)

    def small(self, index: int):
        return self._small[index]

    def column(self, name: str) -> np.ndarray:
        return self._small[name][: self.count]

    def timing(self, name: str) -> np.ndarray:
        return self._timings[: self.count, TIMINGS.index(name)]

    def record(self, index: int, token_text) -> StepRecord:
        """Record `index` rebuilt whole (equal to the one appended)."""
        shape = self._grid_shape()
        layers, pages, _ = shape
        cuts = self._cuts[index].astype(np.int64)
        blob = os.pread(self._fd, int(cuts[-1]), int(self._starts[index]))

        def part(name: str, dtype) -> np.ndarray:
            i = self.parts.index(name)
            return np.frombuffer(blob, dtype=dtype, count=int(cuts[i + 1] - cuts[i]) // np.dtype(dtype).itemsize,
                                 offset=int(cuts[i]))

        attention_layers = tuple(part("attention_layers", np.int16).tolist())
        weights = part("attention", np.float16)
        attention = weights.reshape(len(attention_layers), self.n_heads, -1) if attention_layers else ()
        tables = part("block_tables", np.int32).reshape(layers, -1)
        events = EventArray(part("events", EVENT_DTYPE), self.strings)
        s = self._small[index]
        floats = part("recall", np.float32)
        by_head = floats[layers:] if part("tier_counts", np.int64).size and s["has_oracle"] else floats
        oracle = OracleStep(float(s["kl"]), bool(s["top1"]), float(s["lp_bounded"]), float(s["lp_full"]),
                            float(s["lost"]), tuple(map(tuple, by_head.reshape(len(attention_layers), -1).tolist()))
                            if by_head.size else None) if s["has_oracle"] else None
        timings = {name: float(v) for name, v in zip(TIMINGS, self._timings[index]) if v == v}
        next_token = int(s["next_token"])
        return self._record_type(
            kind=RECORD_KINDS[s["kind"]], token_ids=tuple(part("token_ids", np.int64).tolist()),
            positions=tuple(part("positions", np.int64).tolist()),
            next_text=token_text(next_token) if next_token >= 0 else "",
            block_tables=tuple(tuple(int(p) for p in row[row >= 0]) for row in tables),
            events=events, attention_layers=attention_layers, attention=tuple(attention), timings=timings,
            oracle=oracle, tiers=self._tiers(part, tables, attention_layers),
            **{f.name: s[f.name].item() for f in self._scalars},
            **{f.name: _grid_of(part(f.name, np.uint8), f.dtype, shape if f.stored == "grid" else (layers,))
               for f in self._grids})

    def _tiers(self, part, tables: np.ndarray, attention_layers: tuple[int, ...]) -> TierStep | None:
        counts = part("tier_counts", np.int64)
        if not counts.size:
            return None
        layers = tables.shape[0]
        maps = part("page_maps", np.int32)
        frames = part("block_frames", np.int32).reshape(tables.shape)
        recall = part("recall", np.float32)[:layers]  # (the oracle's lost attention per head follows)
        return TierStep(counts=counts.reshape(layers, -1),
                        page_maps=maps.reshape(len(attention_layers), -1, self._grid_shape()[2]),
                        block_frames=tuple(tuple(int(f) for f in frames[layer, : int((tables[layer] >= 0).sum())])
                                           for layer in range(layers)),
                        recall=recall if recall.size else None)


def _oracle_floats(record: StepRecord) -> np.ndarray:
    """The record's "recall" part: the tier recall, then the oracle's lost attention per recorded layer and head."""
    tiers, oracle = record.tiers, record.oracle
    recall = np.asarray(tiers.recall, np.float32).ravel() if tiers and tiers.recall is not None else np.zeros(0)
    by_head = np.asarray(oracle.lost_by_head, np.float32).ravel() if oracle and oracle.lost_by_head else np.zeros(0)
    return np.concatenate([recall, by_head]).astype(np.float32)


def _grow(array: np.ndarray, needed: int) -> np.ndarray:
    """`array` with room for index `needed` (doubling), contents kept."""
    if needed < len(array):
        return array
    grown = np.zeros((max(16, 2 * len(array), needed + 1),) + array.shape[1:], dtype=array.dtype)
    grown[: len(array)] = array
    return grown


def _grid_bytes(grid: np.ndarray | None, dtype: str) -> np.ndarray:
    """A grid field's part: its values (a bool grid bit-packed); None (an optional grid's) as no bytes."""
    if grid is None:
        return np.zeros(0, np.uint8)
    if np.dtype(dtype) == np.bool_:
        return np.packbits(grid)
    return np.ascontiguousarray(grid, dtype)


def _grid_of(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A grid field back from its part's bytes (`_grid_bytes`)."""
    if not data.size:
        return None
    if np.dtype(dtype) == np.bool_:
        return np.unpackbits(data, count=int(np.prod(shape))).astype(bool).reshape(shape)
    return data.view(dtype).reshape(shape)

"""The machinery of the step record's field table (the record itself is declared in step_record.py).

Each field of the StepRecord dataclass carries its row in its metadata (`row(...)`): what it holds, how it is
stored, and the range a trace's values must keep. A RecordTable reads them off the class as RecordFields (name,
type and default from the dataclass field, the rest from the row), and is what the spill (viewmodel/spill.py) and
the trace format (trace/schema.py, trace/file.py) derive their parts and arrays from, read at call time
(`step_record.TABLE`), so one more annotated field is all a new field needs.

How a field is stored (`stored`):
  "scalar"  one number per step, of `dtype`: a column of the spill's small table, a (T,) array in a trace;
  "layers"  one number per layer per step, of `dtype`: a part of the spill, a (T, L) array in a trace;
  "grid"    one (layers, max pages, page size) array per step, of `dtype`: a part of the spill (bool grids
            bit-packed), a (T, L, P, S) array in a trace (XOR-delta encoded if `delta`; a float grid is then
            stored as the unsigned integers of its bits). An `optional` grid (or layers field) may be None: the
            spill writes an empty part, the trace a (T,) bool array `has_<name>` beside it;
  "custom"  its own codec, named by the field in the spill (viewmodel/spill.py) and the trace (trace/file.py):
            tokens, texts, tables, events, attention, timings, the oracle's and the tiers' sub-records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

STORED = ("scalar", "layers", "grid", "custom")
# Each kind's symbolic shape per step: layers, RAM pages (frames), page size
DIMS = {"scalar": (), "layers": ("L",), "grid": ("L", "P", "S")}
# The symbols a bound may name, as a trace's reader knows them (trace/schema.py check_header): T steps, L layers,
# P RAM pages, S page size, B page ids, C slots (B x S), N tokens, E events, A attention layers, H heads.
Bound = int | float | str  # a number, or a symbol, or "symbol-k" / "symbol+k" (e.g. "N-1": the last position)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # a field without a default


def row(doc: str, stored: str = "custom", dtype: str = "", *, optional: bool = False, delta: bool = False,
        since: int = 1, bounds: tuple[Bound, Bound] | None = None) -> dict[str, Any]:
    """A StepRecord field's metadata: its row of the table (RecordField's attributes other than the name, type
    and default, which the dataclass field gives)."""
    return {"row": dict(doc=doc, stored=stored, dtype=dtype, optional=optional, delta=delta, since=since,
                        bounds=bounds)}


@dataclass(frozen=True)
class RecordField:
    """One field of StepRecord, declared once."""

    name: str
    type: str  # the annotation, as written in a dataclass
    doc: str  # what it holds (shapes, units, the empty value): StepRecord's docstring is made of these
    stored: str = "custom"  # one of STORED
    dtype: str = ""  # scalar and grid: the numpy dtype (as a trace's header writes it: "<i4", "|b1", "<f4")
    default: Any = REQUIRED  # or a factory
    factory: Callable[[], Any] | None = None
    optional: bool = False  # a grid or layers field that may be None
    delta: bool = False  # a grid a trace stores as its XOR against the step before
    since: int = 1  # the trace format version that added it (older traces read back its default)
    # The range a trace's values must keep, checked at read time (trace/schema.py check_values) on the trace
    # array of the same name: (low, high), inclusive, each a Bound. None: no range (or checked by its codec).
    bounds: tuple[Bound, Bound] | None = None

    @classmethod
    def of(cls, member: dataclasses.Field) -> RecordField:
        """The row a record's dataclass field declares (its metadata, from `row`)."""
        default = REQUIRED if member.default is dataclasses.MISSING else member.default
        factory = None if member.default_factory is dataclasses.MISSING else member.default_factory
        return cls(member.name, str(member.type), default=default, factory=factory, **member.metadata["row"])

    def member(self) -> tuple[str, str, Any]:
        """This row as a make_dataclass member: (name, annotation, dataclasses.field with its default and row)."""
        metadata = row(self.doc, self.stored, self.dtype, optional=self.optional, delta=self.delta,
                       since=self.since, bounds=self.bounds)
        if self.factory is not None:
            return self.name, self.type, dataclasses.field(default_factory=self.factory, metadata=metadata)
        if self.default is not REQUIRED:
            return self.name, self.type, dataclasses.field(default=self.default, metadata=metadata)
        return self.name, self.type, dataclasses.field(metadata=metadata)

    def __post_init__(self):
        if self.stored not in STORED:
            raise ValueError(f"record field {self.name}: stored must be one of {STORED}, not {self.stored!r}")
        if self.stored != "custom" and not self.dtype:
            raise ValueError(f"record field {self.name}: a {self.stored} needs a dtype")
        if self.optional and (self.stored not in ("grid", "layers") or self.default is not None):
            raise ValueError(f"record field {self.name}: only a grid or layers field may be optional, with "
                             "default None")
        if self.since > 1 and not self.has_default:
            raise ValueError(f"record field {self.name}: a field added after version 1 needs a default "
                             "(what older traces read back)")

    @property
    def has_default(self) -> bool:
        return self.default is not REQUIRED or self.factory is not None

    def empty(self) -> Any:
        """The default value (a fresh one from the factory)."""
        return self.factory() if self.factory is not None else self.default

    @property
    def trace_dtype(self) -> str:
        """The dtype of the trace's array: a delta-encoded float grid as the unsigned integers of its bits."""
        dtype = np.dtype(self.dtype)
        if self.delta and dtype.kind == "f":
            dtype = np.dtype(f"<u{dtype.itemsize}")
        return dtype.str

    def limits(self, sizes: Mapping[str, int]) -> tuple[float, float] | None:
        """`bounds` with its symbols replaced by a trace's sizes."""
        return None if self.bounds is None else bound_limits(self.bounds, sizes)


def bound_limits(bounds: tuple[Bound, Bound], sizes: Mapping[str, int]) -> tuple[float, float]:
    """A (low, high) pair of bounds with their symbols replaced by a trace's sizes (high no lower than low)."""
    low, high = (_evaluate(b, sizes) for b in bounds)
    return low, max(low, high)


def _evaluate(bound: Bound, sizes: Mapping[str, int]) -> float:
    if not isinstance(bound, str):
        return bound
    for sign in "-+":
        symbol, _, number = bound.partition(sign)
        if number:
            return sizes[symbol] + (int(number) if sign == "+" else -int(number))
    return sizes[bound]


class RecordTable:
    """A record dataclass (StepRecord) and its fields' rows, in declaration order."""

    def __init__(self, record: type):
        self.record = record
        self.fields = tuple(RecordField.of(member) for member in dataclasses.fields(record))

    def __getitem__(self, name: str) -> RecordField:
        return next(f for f in self.fields if f.name == name)

    def of(self, *stored: str) -> tuple[RecordField, ...]:
        """The fields stored as one of `stored` ("scalar", "layers", "grid", "custom"), in table order."""
        return tuple(f for f in self.fields if f.stored in stored)

    @property
    def version(self) -> int:
        """The newest trace format version a field of the table needs."""
        return max(f.since for f in self.fields)

    def with_field(self, field: RecordField) -> RecordTable:
        """This table and one more field at its end, with a record class of its own, a subclass of this one's (for
        tests: a new field belongs in StepRecord)."""
        if field.name in {f.name for f in self.fields}:
            raise ValueError(f"record fields named twice: [{field.name!r}]")
        record = dataclasses.make_dataclass(self.record.__name__, [field.member()], bases=(self.record,),
                                            frozen=True)
        record.__module__ = self.record.__module__
        return RecordTable(record)

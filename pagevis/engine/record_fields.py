"""The machinery of the step record's field table (the table itself is in step_record.py).

A RecordField declares one field of StepRecord: its type and default, how it is stored, and the range a trace's
values must keep. A RecordTable turns a tuple of them into the StepRecord class, and is what the spill
(viewmodel/spill.py) and the trace format (trace/schema.py, trace/file.py) derive their parts and arrays from,
read at call time (`step_record.TABLE`), so a table with one more field is all a new field needs.

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
    """A tuple of RecordFields and the record class made from it (fields in table order; methods from `base`)."""

    def __init__(self, fields: tuple[RecordField, ...], base: type, name: str = "StepRecord", module: str = __name__):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"record fields named twice: {sorted({n for n in names if names.count(n) > 1})}")
        self.fields = tuple(fields)
        self.base, self._name, self._module = base, name, module
        members = [(f.name, f.type, dataclasses.field(default_factory=f.factory) if f.factory is not None
                    else dataclasses.field(default=f.default) if f.default is not REQUIRED else dataclasses.field())
                   for f in fields]
        self.record = dataclasses.make_dataclass(name, members, bases=(base,), frozen=True)
        self.record.__module__ = module  # (pickle finds it there)
        self.record.__doc__ = (base.__doc__ or "").rstrip() + "\n\nFields (step_record.FIELDS):\n" + "\n".join(
            f"  {f.name}: {f.doc}" for f in fields)

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
        """This table and one more field at its end, with a record class of its own (for tests: a new field
        belongs in step_record.FIELDS)."""
        return RecordTable(self.fields + (field,), self.base, self._name, self._module)

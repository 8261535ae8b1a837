"""Trace files: one decode session kept on disk, to replay every view and scrub it exactly as it was live.

A trace is a zip archive (deflate) holding `header.json` (format, version, configuration, tokens, strings)
and one `.npy` array per field, stacked over steps. Nothing is pickled: arrays are read with
allow_pickle=False and the header is plain JSON, so the file opens without pagevis (docs/trace-format.md).

Per-step state that changes little between steps (slot maps, protected flags, policy scores, block
tables) is stored as an XOR delta against the previous step, which deflate squeezes to almost nothing;
reading undoes it exactly (bit for bit, also for NaN scores). Events are stored as columns.

The record's scalar, layers and grid fields are written and read from its field table (engine/step_record.py FIELDS:
`_field_builders`, `_field_values`); the custom fields have their codecs here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from pagevis import __version__, settings
from pagevis.engine import ModelSpec, OracleStep, SessionConfig, StepRecord, TierStep, step_record
from pagevis.engine.record_fields import DIMS, RecordField
from pagevis.engine.table_log import TablesAt
from pagevis.kvcache import COUNT_NAMES, CacheEvent, ConfigError, EventKind
from pagevis.kvcache.event_array import EventArray, Strings, to_rows
from pagevis.trace.archive import Archive, TraceError
from pagevis.kvcache.quant import storage_text
from pagevis.trace.schema import (
    FORMAT,
    KINDS,
    MAX_HEADER_BYTES,
    ORACLE_COLUMNS,
    VERSION,
    arrays_of_version,
    check_header,
    check_kv_layout,
    check_values,
    config_from_dict,
    delta_encoded,
    expected_arrays,
    format_version,
)

__all__ = ["FORMAT", "SUFFIX", "VERSION", "Trace", "TraceError", "read_trace", "record_differences", "write_trace"]

SUFFIX = ".pvtrace"
HEADER = "header.json"
EVENT_KINDS = tuple(EventKind)


@dataclass
class Trace:
    """Everything a replay needs. `model_spec`, `stop_reason` and `text` are extras a live run knows."""

    model_label: str
    prompt: str
    config: SessionConfig
    prompt_ids: tuple[int, ...]
    records: list[StepRecord]
    token_texts: dict[int, str]
    model_spec: ModelSpec | None = None
    stop_reason: str | None = None
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # free-form (e.g. the command line), kept as JSON
    kv_layout: dict[str, Any] = field(default_factory=dict)  # schema.check_kv_layout; {}: unknown (older traces)

    @classmethod
    def from_session(cls, session, model_label: str | None = None, model_spec: ModelSpec | None = None,
                     meta: dict[str, Any] | None = None) -> Trace:
        ids = set(session.prompt_ids)
        for record in session.records:
            ids.update(record.token_ids)
            if record.next_token >= 0:
                ids.add(record.next_token)
        label = model_label or (model_spec.label if model_spec else session.model.config.name)
        return cls(model_label=label, prompt=session.prompt, config=session.config,
                   prompt_ids=tuple(int(t) for t in session.prompt_ids), records=list(session.records),
                   token_texts={int(t): session.token_text(t) for t in sorted(ids)}, model_spec=model_spec,
                   stop_reason=session.stop_reason, text=session.text(), meta=dict(meta or {}),
                   kv_layout=kv_layout(session.model.config, session.cache_config))


def kv_layout(model_config, cache) -> dict[str, Any]:
    """What a replay shows of the model's heads and the cache's size (the trace's `kv_layout` header)."""
    return {"n_heads": model_config.n_heads, "n_kv_heads": model_config.n_kv_heads, "cache_bytes": cache.total_bytes(),
            "kv_bytes_per_token": cache.kv_bytes_per_token(), "storage": storage_text(cache)}


# --- writing ---------------------------------------------------------------------------------------

def write_trace(path, source, *, model_label: str | None = None, model_spec: ModelSpec | None = None,
                meta: dict[str, Any] | None = None) -> int:
    """Write a Trace, or a DecodeSession's records so far, to `path`; return the file's size in bytes.

    The file is written next to `path` and renamed into place, so a crash never leaves half a trace.
    """
    trace = source if isinstance(source, Trace) else Trace.from_session(source, model_label, model_spec, meta)
    header, builders = _encode(trace)
    path = os.fspath(path)
    partial = path + ".partial"
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        archive.writestr(HEADER, json.dumps(header, ensure_ascii=False, allow_nan=False, indent=1))
        for name, build in builders.items():  # one array in memory at a time, streamed through deflate
            array = np.ascontiguousarray(build())
            spec = header["arrays"][name]
            if array.dtype.str != spec["dtype"] or list(array.shape) != spec["shape"]:
                raise AssertionError(f"array {name} is {array.dtype.str} {list(array.shape)}, the format says {spec}")
            with archive.open(f"{name}.npy", "w", force_zip64=array.nbytes > (1 << 31) - (1 << 20)) as stream:
                _write_npy(stream, array)
            del array
    os.replace(partial, path)
    return os.path.getsize(path)


class _Shape(NamedTuple):
    """The sizes every record of a trace shares."""

    n_layers: int
    max_pages: int
    page_size: int
    n_page_ids: int
    map_pages: int  # pages in the tier page maps: n_page_ids with a disk tier, else 0
    attention_layers: tuple[int, ...]
    n_heads: int
    timing_keys: list[str]
    tiered: list[bool]  # per record: has tier counts


# The record's custom fields (step_record.FIELDS), each with its arrays (or header keys) here.
CUSTOM_FIELDS = ("kind", "token_ids", "positions", "next_text", "block_tables", "events", "attention_layers",
                 "attention", "timings", "oracle", "tiers")
EVENT_COLUMNS = {"kind": np.int8, "step": np.int64, "layer": np.int32, "page": np.int32, "slot": np.int32,
                 "position": np.int64, "policy": np.int32, "reason": np.int32, "score": np.float64,
                 "frame": np.int32, "seq": np.int32, "detail": np.int64}


def _encode(trace: Trace) -> tuple[dict, dict[str, Callable[[], np.ndarray]]]:
    """The header, and a builder per array (its dtype and shape are the format table's, in the header)."""
    records = trace.records
    shape = _shape_of(trace)
    strings = Strings()  # the string table goes in the header, built with the events' rows
    events = np.concatenate([to_rows(r.events, strings) for r in records])
    sizes = {"T": len(records), "T1": len(records) + 1, "N": sum(len(r.token_ids) for r in records),
             "E": len(events), "L": shape.n_layers, "P": shape.max_pages, "S": shape.page_size,
             "B": shape.n_page_ids, "C": shape.n_page_ids * shape.page_size, "A": len(shape.attention_layers),
             "H": shape.n_heads, "K": len(shape.timing_keys), "O": len(ORACLE_COLUMNS), "D": shape.map_pages,
             "Q": len(COUNT_NAMES)}
    builders = {**_record_builders(records, shape), **_field_builders(records, shape), **_tier_builders(records, shape),
                **{f"event_{column}": (lambda c=column, d=dtype: events[c].astype(d))
                   for column, dtype in EVENT_COLUMNS.items()}}
    # built one at a time by write_trace, in the format table's order, so that only one is in memory
    return _header(trace, shape, strings, sizes), {name: builders[name] for name in arrays_of_version(format_version())}


def _shape_of(trace: Trace) -> _Shape:
    records = trace.records
    if not records:
        raise ValueError("a trace needs at least one step")
    first = records[0]
    attention_layers = tuple(first.attention_layers)
    for record in records:
        if record.slot_maps.shape != first.slot_maps.shape or tuple(record.attention_layers) != attention_layers:
            raise ValueError(f"step {record.step} has a different cache shape or attention layers than step 0")
    tiered = [r.tiers is not None for r in records]
    n_page_ids = trace.config.n_page_ids
    return _Shape(*first.slot_maps.shape, n_page_ids, n_page_ids if any(tiered) else 0, attention_layers,
                  first.attention[0].shape[0] if first.attention else 0,
                  sorted({key for record in records for key in record.timings}), tiered)


def _record_builders(records: list, shape: _Shape) -> dict[str, Callable[[], np.ndarray]]:
    """The custom fields' arrays of every step: tokens, block tables, attention, timings, the oracle's columns."""
    T, L, B = len(records), shape.n_layers, shape.n_page_ids
    heads = (T, len(shape.attention_layers), shape.n_heads)
    keys = shape.timing_keys
    return {
        "kind": lambda: np.array([KINDS.index(r.kind) for r in records], dtype=np.int8),
        "token_offsets": lambda: _offsets([len(r.token_ids) for r in records]),
        "token_ids": lambda: np.array([t for r in records for t in r.token_ids], dtype=np.int64),
        "positions": lambda: np.array([p for r in records for p in r.positions], dtype=np.int64),
        "block_tables": lambda: xor_delta(_stack((_pad_tables(r.block_tables, L, B) for r in records), (T, L, B),
                                                 np.int32)),
        "event_offsets": lambda: _offsets([len(r.events) for r in records]),
        "attention": lambda: _stack((np.stack(r.attention) if r.attention else () for r in records),
                                    (*heads, B * shape.page_size), np.float16),
        "timings": lambda: np.array([[r.timings.get(k, math.nan) for k in keys] for r in records],
                                    dtype=np.float64).reshape(T, len(keys)),
        "has_oracle": lambda: np.array([r.oracle is not None for r in records], dtype=bool),
        "oracle": lambda: np.array([_oracle_row(r.oracle) for r in records],
                                   dtype=np.float64).reshape(T, len(ORACLE_COLUMNS)),
        "oracle_lost_by_head": lambda: _stack((r.oracle.lost_by_head if r.oracle is not None and
                                               r.oracle.lost_by_head is not None else np.nan for r in records),
                                              heads, np.float32),
    }


def _field_builders(records: list, shape: _Shape) -> dict[str, Callable[[], np.ndarray]]:
    """The arrays of the record table's scalar, layers and grid fields (schema.field_arrays): stacked over steps
    (an optional field's None as zeros, with `has_<name>`), XOR-delta encoded if the table says so."""
    sizes = {"L": shape.n_layers, "P": shape.max_pages, "S": shape.page_size}

    def build(f: RecordField) -> np.ndarray:
        dtype = np.dtype(f.dtype)
        if f.stored == "scalar":
            return np.array([getattr(r, f.name) for r in records], dtype=dtype)
        values = (getattr(r, f.name) for r in records)
        full = (len(records), *(sizes[d] for d in DIMS[f.stored]))
        stacked = _stack((0 if v is None else v for v in values), full, dtype).view(f.trace_dtype)
        return xor_delta(stacked) if f.delta else stacked

    builders = {}
    for f in step_record.TABLE.fields:
        if f.optional:
            builders[f"has_{f.name}"] = lambda f=f: np.array([getattr(r, f.name) is not None for r in records], bool)
        if f.stored != "custom":
            builders[f.name] = lambda f=f: build(f)
    return builders


def _tier_builders(records: list, shape: _Shape) -> dict[str, Callable[[], np.ndarray]]:
    """The disk tier's arrays: counts, page maps, block frames, Quest's recall."""
    T, L, B = len(records), shape.n_layers, shape.n_page_ids
    return {
        "has_tiers": lambda: np.array(shape.tiered, dtype=bool),
        "tier_counts": lambda: _stack((r.tiers.counts if r.tiers else 0 for r in records), (T, L, len(COUNT_NAMES)),
                                      np.int64),
        "page_maps": lambda: xor_delta(_stack((r.tiers.page_maps if r.tiers else -1 for r in records),
                                              (T, len(shape.attention_layers), shape.map_pages, shape.page_size),
                                              np.int32)),
        "block_frames": lambda: xor_delta(_stack((_pad_tables(r.tiers.block_frames if r.tiers else (), L, B)
                                                  for r in records), (T, L, B), np.int32)),
        "recall": lambda: _stack((r.tiers.recall if r.tiers and r.tiers.recall is not None else np.nan
                                  for r in records), (T, L), np.float32),
    }


def _header(trace: Trace, shape: _Shape, strings: Strings, sizes: dict[str, int]) -> dict:
    return {
        "format": FORMAT,
        "version": format_version(),
        "written_by": f"pagevis {__version__}",
        "model_label": trace.model_label,
        "model": dataclasses.asdict(trace.model_spec) if trace.model_spec else None,
        "prompt": trace.prompt,
        "prompt_ids": [int(t) for t in trace.prompt_ids],
        "config": config_to_dict(trace.config),
        "stop_reason": trace.stop_reason,
        "text": trace.text,
        "n_steps": len(trace.records),
        "n_layers": shape.n_layers, "max_pages": shape.max_pages, "page_size": shape.page_size,
        "n_heads": shape.n_heads, "n_page_ids": shape.n_page_ids, "page_map_pages": shape.map_pages,
        "attention_layers": list(shape.attention_layers),
        "kinds": list(KINDS),
        "event_kinds": [k.value for k in EVENT_KINDS],
        "strings": strings.texts,
        "timing_keys": shape.timing_keys,
        "oracle_columns": list(ORACLE_COLUMNS),
        "next_texts": [r.next_text for r in trace.records],
        "token_texts": {str(k): v for k, v in sorted(trace.token_texts.items())},
        "delta_encoded": delta_encoded(format_version()),
        "arrays": {name: {"dtype": np.dtype(spec.dtype).str, "shape": [sizes[symbol] for symbol in spec.dims]}
                   for name, spec in arrays_of_version(format_version()).items()},
        "meta": trace.meta,
        "kv_layout": trace.kv_layout or None,
    }


def _write_npy(stream, array: np.ndarray) -> None:
    """An .npy file (format 1.0, C order, never pickle) written in 1 MiB slices of the array's own memory
    (np.lib.format.write_array copies 16 M-element chunks twice)."""
    np.lib.format.write_array_header_1_0(stream, np.lib.format.header_data_from_array_1_0(array))
    data = memoryview(array.reshape(-1).view(np.uint8))
    for start in range(0, len(data), 1 << 20):
        stream.write(data[start: start + (1 << 20)])


def _stack(arrays, shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.stack into one preallocated array: no list of per-step copies next to the result."""
    out = np.empty(shape, dtype=dtype)
    if out.size:
        for index, array in enumerate(arrays):
            out[index] = array
    return out


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def _pad_tables(tables, n_layers: int, max_pages: int) -> np.ndarray:
    padded = np.full((n_layers, max_pages), -1, dtype=np.int32)
    for layer, table in enumerate(tables):
        padded[layer, : len(table)] = table
    return padded


def _oracle_row(oracle: OracleStep | None) -> list[float]:
    if oracle is None:
        return [math.nan] * 5
    return [oracle.kl, float(oracle.top1_agree), oracle.logprob_bounded, oracle.logprob_full, oracle.lost_attention]


def xor_delta(stacked: np.ndarray) -> np.ndarray:
    """Each step XOR the step before (step 0 as is): unchanged entries become 0. Integer or bool input,
    overwritten in place (last step first, so each step still sees the original one before it)."""
    for step in range(len(stacked) - 1, 0, -1):
        stacked[step] ^= stacked[step - 1]
    return stacked


def undo_xor_delta(delta: np.ndarray) -> np.ndarray:
    return np.bitwise_xor.accumulate(delta, axis=0)


def config_to_dict(config: SessionConfig) -> dict:
    """The header's `config`: the settings table's JSON form of the session's settings."""
    return settings.to_dict(config)


# --- reading ---------------------------------------------------------------------------------------

def read_trace(path) -> Trace:
    """Load and validate a trace; TraceError naming the file and the problem if it cannot be replayed.

    The header is checked against the format's schema before any array is read, each array's size is
    known (and capped) before it is allocated, and every index the arrays hold is bounded after reading
    (pagevis/trace/schema.py). Reading never uses more than about the size of the arrays it returns.
    """
    name = os.fspath(path)
    with Archive(name) as archive:
        header = archive.read_json(HEADER, MAX_HEADER_BYTES)
        sizes = check_header(header, name)
        header["kv_layout"] = check_kv_layout(header.get("kv_layout"), name)
        expected = expected_arrays(header, sizes, name)
        arrays = {key: archive.read_npy(f"{key}.npy", dtype, shape) for key, (dtype, shape) in expected.items()}
    for key in header["delta_encoded"]:
        arrays[key] = undo_xor_delta(arrays[key])
    check_values(arrays, header, sizes, name)
    try:
        return _decode(header, arrays)
    except (KeyError, IndexError, TypeError, ValueError, ConfigError) as error:  # a gap in the schema: still one line
        raise TraceError(f"{name}: the trace is inconsistent ({type(error).__name__}: {error})") from None


def _decode(header: dict, a: dict[str, np.ndarray]) -> Trace:
    """Records from arrays that passed check_values (deltas already undone)."""
    n = header["n_steps"]
    layers = tuple(header["attention_layers"])
    tables = a["block_tables"]
    token_offsets, event_offsets = a["token_offsets"], a["event_offsets"]
    strings = header["strings"]
    event_kinds = [EventKind(k) for k in header["event_kinds"]]
    kinds = header["kinds"]
    n_events = len(a["event_kind"])
    frames = a["event_frame"].tolist() if "event_frame" in a else [-1] * n_events  # version 1: none
    seqs = a["event_seq"].tolist() if "event_seq" in a else [0] * n_events  # before version 3: one sequence
    details = a["event_detail"].tolist() if "event_detail" in a else [-1] * n_events
    events = [
        CacheEvent(event_kinds[k], int(s), int(layer), int(page), int(slot), int(pos), strings[pol], strings[rea],
                   float(score), int(frame), int(seq), int(detail))
        for k, s, layer, page, slot, pos, pol, rea, score, frame, seq, detail in zip(
            a["event_kind"].tolist(), a["event_step"].tolist(), a["event_layer"].tolist(),
            a["event_page"].tolist(), a["event_slot"].tolist(), a["event_position"].tolist(),
            a["event_policy"].tolist(), a["event_reason"].tolist(), a["event_score"].tolist(), frames, seqs,
            details, strict=True)
    ]
    timing_keys = header["timing_keys"]
    next_texts = header["next_texts"]
    record_type, fields = step_record.TABLE.record, _field_values(a)
    records = []
    for i in range(n):
        t0, t1 = int(token_offsets[i]), int(token_offsets[i + 1])
        e0, e1 = int(event_offsets[i]), int(event_offsets[i + 1])
        oracle = None
        if a["has_oracle"][i]:
            kl, agree, lp_bounded, lp_full, lost = a["oracle"][i].tolist()
            by_head = a["oracle_lost_by_head"][i] if "oracle_lost_by_head" in a and layers else None
            oracle = OracleStep(kl=kl, top1_agree=bool(agree), logprob_bounded=lp_bounded, logprob_full=lp_full,
                                lost_attention=lost, lost_by_head=None if by_head is None or np.isnan(by_head).all()
                                else tuple(map(tuple, by_head.tolist())))
        records.append(record_type(
            kind=kinds[int(a["kind"][i])],
            token_ids=tuple(a["token_ids"][t0:t1].tolist()), positions=tuple(a["positions"][t0:t1].tolist()),
            next_text=next_texts[i],
            block_tables=tuple(tuple(int(p) for p in row[row >= 0]) for row in tables[i]),
            events=tuple(events[e0:e1]), attention_layers=layers,
            attention=tuple(a["attention"][i, j] for j in range(len(layers))),
            timings={k: v for k, v in zip(timing_keys, a["timings"][i].tolist()) if not math.isnan(v)},
            oracle=oracle, tiers=_tiers(a, i), **fields(i),
        ))
    model = header.get("model")
    return Trace(
        model_label=header["model_label"], prompt=header["prompt"], config=config_from_dict(header["config"]),
        prompt_ids=tuple(int(t) for t in header["prompt_ids"]), records=records,
        token_texts={int(k): v for k, v in header["token_texts"].items()},
        model_spec=ModelSpec(**model) if model else None, stop_reason=header.get("stop_reason"),
        text=header.get("text", ""), meta=header.get("meta") or {},
        kv_layout=header.get("kv_layout") or {},
    )


def _field_values(a: dict[str, np.ndarray]) -> Callable[[int], dict[str, Any]]:
    """Step i's scalar, layers and grid fields from their arrays (deltas undone); a field the trace's version predates
    (no array) reads back as its default, an optional one whose `has_<name>` is false as None."""
    table = step_record.TABLE
    present = [f for f in table.fields if f.stored != "custom" and f.name in a]
    absent = {f.name: f for f in table.fields if f.stored != "custom" and f.name not in a}
    stored = {f.name: a[f.name].view(f.dtype) for f in present}

    def values(i: int) -> dict[str, Any]:
        found = {name: f.empty() for name, f in absent.items()}
        for f in present:
            if f.optional and not a[f"has_{f.name}"][i]:
                found[f.name] = None
            else:
                found[f.name] = stored[f.name][i].item() if f.stored == "scalar" else stored[f.name][i]
        return found

    return values


def _tiers(a: dict[str, np.ndarray], i: int) -> TierStep | None:
    if "has_tiers" not in a or not a["has_tiers"][i]:
        return None
    recall = a["recall"][i]
    return TierStep(counts=a["tier_counts"][i], page_maps=a["page_maps"][i],
                    block_frames=tuple(tuple(int(f) for f in row[: len(table)])  # -1 is a page on disk: cut by length
                                       for row, table in zip(a["block_frames"][i], _tables(a, i), strict=True)),
                    recall=None if np.all(np.isnan(recall)) else recall)


def _tables(a: dict[str, np.ndarray], i: int) -> list[np.ndarray]:
    return [row[row >= 0] for row in a["block_tables"][i]]


# --- comparing -------------------------------------------------------------------------------------

def record_differences(a: StepRecord, b: StepRecord) -> list[str]:
    """Names of the fields in which two records differ (arrays compared exactly, NaN equal to NaN)."""
    differ = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not _same(x, y):
            differ.append(f.name)
    return differ


def _same(x, y) -> bool:
    # a session's tables and events (views of compact logs), compared as the tuples a trace reads back
    x, y = (tuple(v) if isinstance(v, (TablesAt, EventArray)) else v for v in (x, y))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        x, y = np.asarray(x), np.asarray(y)
        return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(
            x, y, equal_nan=x.dtype.kind in "fc")
    if isinstance(x, numbers.Real) and isinstance(y, numbers.Real) and isinstance(x, bool) == isinstance(y, bool):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
        return type(x) is type(y) and all(_same(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    return type(x) is type(y) and x == y

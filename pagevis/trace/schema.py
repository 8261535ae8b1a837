"""What a trace's header.json and arrays must hold, as tables: checked before anything is allocated.

The header is checked field by field (type, range), then against itself (the configuration agrees with
the shapes, record layers with attention layers), and it fixes the dtype and shape of every array from
`arrays()`, a table of symbolic shapes per format version: the custom arrays below (CUSTOM_ARRAYS) and one
per scalar or grid field of the step record's field table (engine/step_record.py FIELDS). After reading,
`check_values` bounds every index an array holds (kinds, layers, pages, slots, positions, string-table
entries; a field's range is its `bounds` in the field table), so that the records built from an accepted file
cannot send a view out of range.

A new record field is a row of the field table (with `since`: the format version becomes the newest `since`);
other new arrays are rows of CUSTOM_ARRAYS (with `since`), new event kinds are the EventKind enum's; the checks
below are driven by those tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from pagevis import settings
from pagevis.engine import ModelSpec, SamplingConfig, SessionConfig, step_record
from pagevis.engine.record_fields import DIMS, RecordTable, bound_limits
from pagevis.kvcache import COUNT_NAMES, POLICIES, ConfigError, EventKind
from pagevis.kvcache.config import MAX_HEADS, MAX_LAYERS
from pagevis.settings import MAX_PAGE_SIZE, MAX_PAGES, STORAGE_DTYPES
from pagevis.system_memory import available_bytes, fits, gib
from pagevis.trace.archive import TraceError

FORMAT = "pagevis-trace"
BASE_VERSION = 4  # 2: disk tier and page selection (event frames, per-page maps, tier counts, recall);
# 3: the one engine (events name their sequence and a detail; sharing, prefix-cache and sequence events);
# 4: per-head policies (mask events) and the oracle's lost attention per recorded layer and head; quantized
# storage (int4 / int2: which slots are still in full precision). Later versions: a record field's `since`.
KINDS = ("prefill", "decode")
ORACLE_COLUMNS = ("kl", "top1_agree", "logprob_bounded", "logprob_full", "lost_attention")
CUSTOM_DELTA = ("block_tables", "page_maps", "block_frames")  # custom arrays stored as XOR deltas
MAX_HEADER_BYTES = 64 << 20
MAX_TRACE_BYTES = 2 << 30  # arrays and the records' Python objects, as held in memory once read
# Python objects the records hold beyond the arrays (measured with tracemalloc on a 1.5k-step trace: 3.9 KB per
# step in all; these bounds are deliberately high): per step, per event, per token, per block-table entry.
OBJECT_BYTES = {"T": 2048, "E": 300, "N": 80, "table entry": 36}
MAX_STEPS = 10_000_000
MAX_TOKEN_ID = step_record.MAX_TOKEN_ID


@dataclass(frozen=True)
class ArraySpec:
    dtype: str
    dims: tuple[str, ...]  # symbols: T steps, T1 steps+1, N tokens, E events, L layers, P RAM pages, S page
    since: int = 1  # size, B page ids (= P without a disk tier), C slots (B * S), A attention layers,
    # H heads, K timing keys, O oracle columns, D pages in page maps (B, or 0), Q tier count columns


# The arrays that are not one scalar or grid field of the record each: the custom fields' (tokens, tables,
# events, attention, timings, the oracle's and the tiers') and the offsets that index them.
CUSTOM_ARRAYS = {
    "kind": ArraySpec("|i1", ("T",)),
    "token_offsets": ArraySpec("<i8", ("T1",)),
    "token_ids": ArraySpec("<i8", ("N",)),
    "positions": ArraySpec("<i8", ("N",)),
    "block_tables": ArraySpec("<i4", ("T", "L", "B")),
    "event_offsets": ArraySpec("<i8", ("T1",)),
    "event_kind": ArraySpec("|i1", ("E",)),
    "event_step": ArraySpec("<i8", ("E",)),
    "event_layer": ArraySpec("<i4", ("E",)),
    "event_page": ArraySpec("<i4", ("E",)),
    "event_slot": ArraySpec("<i4", ("E",)),
    "event_position": ArraySpec("<i8", ("E",)),
    "event_policy": ArraySpec("<i4", ("E",)),
    "event_reason": ArraySpec("<i4", ("E",)),
    "event_score": ArraySpec("<f8", ("E",)),
    "attention": ArraySpec("<f2", ("T", "A", "H", "C")),
    "timings": ArraySpec("<f8", ("T", "K")),
    "has_oracle": ArraySpec("|b1", ("T",)),
    "oracle": ArraySpec("<f8", ("T", "O")),
    "event_frame": ArraySpec("<i4", ("E",), since=2),
    "has_tiers": ArraySpec("|b1", ("T",), since=2),
    "tier_counts": ArraySpec("<i8", ("T", "L", "Q"), since=2),
    "page_maps": ArraySpec("<i4", ("T", "A", "D", "S"), since=2),
    "block_frames": ArraySpec("<i4", ("T", "L", "B"), since=2),
    "recall": ArraySpec("<f4", ("T", "L"), since=2),
    "event_seq": ArraySpec("<i4", ("E",), since=3),
    "event_detail": ArraySpec("<i8", ("E",), since=3),
    "oracle_lost_by_head": ArraySpec("<f4", ("T", "A", "H"), since=4),
}


def field_arrays(table: RecordTable) -> dict[str, ArraySpec]:
    """The arrays of the record table's scalar, layers and grid fields: (T,) per scalar, (T, L) per layers field,
    (T, L, P, S) per grid, and a (T,) bool `has_<name>` before each optional one."""
    found = {}
    for f in table.fields:
        if f.optional:
            found[f"has_{f.name}"] = ArraySpec("|b1", ("T",), since=f.since)
        if f.stored != "custom":
            found[f.name] = ArraySpec(f.trace_dtype, ("T",) + DIMS[f.stored], since=f.since)
    return found


def arrays() -> dict[str, ArraySpec]:
    """Every array of the newest format: CUSTOM_ARRAYS and the record table's (step_record.TABLE, read now)."""
    return {**CUSTOM_ARRAYS, **field_arrays(step_record.TABLE)}


def format_version() -> int:
    """The newest trace format version: this module's, or the newest a record field needs."""
    return max(BASE_VERSION, step_record.TABLE.version)


def delta_encoded(version: int) -> list[str]:
    """The arrays a trace of `version` stores as XOR deltas."""
    table = arrays_of_version(version)
    return [name for name in (*CUSTOM_DELTA, *(f.name for f in step_record.TABLE.fields if f.delta)) if name in table]


VERSION = format_version()  # as this pagevis writes it (a test's wider table writes its own format_version())

# Header keys and their JSON types ("?" = may be null). Keys not listed are ignored (added within a version).
HEADER_TYPES = {
    "format": "str", "version": "int", "model_label": "str", "model": "dict?", "prompt": "str",
    "prompt_ids": "list[int]", "config": "dict", "stop_reason": "str?", "text": "str", "n_steps": "int",
    "n_layers": "int", "max_pages": "int", "page_size": "int", "n_heads": "int", "attention_layers": "list[int]",
    "kinds": "list[str]", "event_kinds": "list[str]", "strings": "list[str]", "timing_keys": "list[str]",
    "oracle_columns": "list[str]", "next_texts": "list[str]", "token_texts": "dict[str]",
    "delta_encoded": "list[str]", "arrays": "dict",
}
OPTIONAL_HEADER_TYPES = {"written_by": "str", "meta": "dict", "n_page_ids": "int", "page_map_pages": "int",
                         "kv_layout": "dict"}  # kv_layout: added within format 4 (older traces lack it)
MAX_STORAGE_TEXT = 2000  # characters of kv_layout's storage line (quant.storage_text with its notices: ~500 at most)


def check_kv_layout(layout: dict | None, where: str) -> dict:
    """The model's head layout and the cache's size a trace states (its `kv_layout` header): n_heads and
    n_kv_heads (query heads read KV head h // (n_heads // n_kv_heads)), cache_bytes, kv_bytes_per_token and a
    storage line. {} for an older trace without it (its replay says the layout is unknown); TraceError if a
    value is off."""
    if not layout:
        return {}
    expected = {"n_heads": int, "n_kv_heads": int, "cache_bytes": int, "kv_bytes_per_token": (int, float),
                "storage": str}
    for key, kind in expected.items():
        value = layout.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            what = getattr(kind, "__name__", "number")
            raise TraceError(f"{where}: header.json kv_layout {key} = {value!r} is not a {what}")
    n_heads, n_kv = layout["n_heads"], layout["n_kv_heads"]
    if not (1 <= n_heads <= MAX_HEADS and 1 <= n_kv <= n_heads and n_heads % n_kv == 0):
        raise TraceError(f"{where}: header.json kv_layout has {n_heads} query heads over {n_kv} KV heads "
                         f"(1 to {MAX_HEADS} query heads, a whole number per KV head)")
    if not (0 <= layout["cache_bytes"] <= 1 << 50 and 0 <= layout["kv_bytes_per_token"] <= 1 << 40):
        raise TraceError(f"{where}: header.json kv_layout sizes are out of range (cache_bytes "
                         f"{layout['cache_bytes']}, kv_bytes_per_token {layout['kv_bytes_per_token']})")
    if len(layout["storage"]) > MAX_STORAGE_TEXT:
        raise TraceError(f"{where}: header.json kv_layout storage is over {MAX_STORAGE_TEXT} characters")
    return {key: layout[key] for key in expected}
# The config's keys and JSON types, from the settings table (record_layers is checked against the arrays).
JSON_TYPES = {"int": "int", "float": "number", "str": "str", "bool": "bool", "params": "dict"}
CONFIG_TYPES = {**{s.name: JSON_TYPES[s.kind] + ("?" if s.nullable else "")
                   for s in settings.settings_of(SessionConfig) if s.kind in JSON_TYPES}, "sampling": "dict"}


# Event kinds a trace may list, by the format version that introduced them (absent: version 1).
# version-1 files written after the disk tier list all six first kinds
EVENT_KIND_SINCE: dict[str, int] = {**{kind: 3 for kind in ("share", "copy_on_write", "fork", "prefix_hit", "store",
                                                            "uncache", "free", "preempt")}, "mask": 4,
                                  "reconstruct": 4}


def event_kinds_of_version(version: int) -> list[str]:
    return [kind.value for kind in EventKind if EVENT_KIND_SINCE.get(kind.value, 1) <= version]


def arrays_of_version(version: int) -> dict[str, ArraySpec]:
    return {name: spec for name, spec in arrays().items() if spec.since <= version}


def check_header(header: Any, where: str) -> dict[str, int]:
    """Validate header.json; return the sizes its symbols stand for (T, L, P, S, ...)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f"{where}: not a pagevis trace (its header does not say format {FORMAT!r})")
    check_version(header, where)
    for key, kind in HEADER_TYPES.items():
        if key not in header:
            raise TraceError(f"{where}: header.json has no {key!r}")
        _check_type(header[key], kind, key, where)
    for key, kind in OPTIONAL_HEADER_TYPES.items():
        if header.get(key) is not None:
            _check_type(header[key], kind, key, where)

    def bounded(key: str, low: int, high: int) -> int:
        if not low <= header[key] <= high:
            raise TraceError(f"{where}: header.json {key} = {header[key]} is out of range (from {low} to {high})")
        return header[key]

    sizes = {"T": bounded("n_steps", 1, MAX_STEPS), "L": bounded("n_layers", 1, MAX_LAYERS),
             "P": bounded("max_pages", 1, MAX_PAGES), "S": bounded("page_size", 1, MAX_PAGE_SIZE),
             "H": bounded("n_heads", 0, MAX_HEADS)}
    sizes["B"] = header.get("n_page_ids", sizes["P"])  # version 1: RAM frames are the page ids
    if not 1 <= sizes["B"] <= MAX_PAGES:
        raise TraceError(f"{where}: header.json n_page_ids = {sizes['B']} is out of range (from 1 to {MAX_PAGES})")
    sizes["D"] = header.get("page_map_pages", 0)
    if sizes["D"] not in (0, sizes["B"]):
        raise TraceError(f"{where}: header.json page_map_pages = {sizes['D']} must be 0 or n_page_ids ({sizes['B']})")
    sizes.update(T1=sizes["T"] + 1, C=sizes["B"] * sizes["S"], A=len(header["attention_layers"]),
                 K=len(header["timing_keys"]), O=len(ORACLE_COLUMNS), Q=len(COUNT_NAMES))
    _check_tables(header, sizes, where)
    _check_config(header, sizes, where)
    _check_model(header, sizes, where)
    return sizes


def check_version(header: dict, where: str) -> int:
    from pagevis import __version__

    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TraceError(f"{where}: the trace header has an invalid format version {version!r} (an integer from 1)")
    if version > (newest := format_version()):
        raise TraceError(f"{where}: written by a newer pagevis ({header.get('written_by', 'unknown')}, trace format "
                         f"version {version}); this pagevis {__version__} reads versions up to {newest}. "
                         "Upgrade pagevis to open it.")
    return version


def expected_arrays(header: dict, sizes: dict[str, int], where: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The dtype and shape of every array, from the format's table; the header's `arrays` must agree.

    N (tokens) and E (events) are free: their value is taken from the header and bounded by the size cap.
    """
    table = arrays_of_version(header["version"])
    listed = header["arrays"]
    unknown = sorted(set(listed) - set(table))
    if unknown:
        raise TraceError(f"{where}: header.json lists array {unknown[0]!r}, which trace format version "
                         f"{header['version']} does not have")
    missing = sorted(set(table) - set(listed))
    if missing:
        raise TraceError(f"{where}: header.json does not list array {missing[0]!r}")
    free = {"N": "token_ids", "E": "event_kind"}
    for symbol, name in free.items():
        shape = _declared(listed, name, where)[1]
        if len(shape) != 1:
            raise TraceError(f"{where}: array {name!r} must have one dimension, the header says {shape}")
        sizes[symbol] = shape[0]
    expected, total = {}, 0
    for name, spec in table.items():
        dtype = np.dtype(spec.dtype)
        shape = tuple(sizes[symbol] for symbol in spec.dims)
        declared = _declared(listed, name, where)
        if declared != (dtype.str, shape):
            raise TraceError(f"{where}: header.json says array {name!r} is {declared[0]} {list(declared[1])}; "
                             f"the trace's sizes make it {dtype.str} {list(shape)}")
        expected[name] = (dtype, shape)
        total += prod(shape) * dtype.itemsize
    total += (sizes["T"] * OBJECT_BYTES["T"] + sizes["E"] * OBJECT_BYTES["E"] + sizes["N"] * OBJECT_BYTES["N"]
              + sizes["T"] * sizes["L"] * sizes["P"] * OBJECT_BYTES["table entry"])
    if total > MAX_TRACE_BYTES or not fits(total):
        raise TraceError(f"{where}: replaying the trace would take about {gib(total)} of memory; pagevis opens traces "
                         f"up to {MAX_TRACE_BYTES >> 30} GiB that fit in the memory available now "
                         f"({gib(available_bytes() or 0)}) (record fewer layers or steps)")
    return expected


def check_values(a: dict[str, np.ndarray], header: dict, sizes: dict[str, int], where: str) -> None:
    """Every index an array holds is in range; offsets index their columns. Arrays as read (deltas undone)."""
    T, L, P, S, N, E = (sizes[k] for k in "TLPSNE")

    def within(name: str, array: np.ndarray, low: int, high: int) -> None:
        if array.size and (array.min() < low or array.max() > high):
            bad = array[(array < low) | (array > high)].flat[0]
            raise TraceError(f"{where}: array {name!r} holds {bad}, outside {low}..{high}")

    if not np.array_equal(a["step"], np.arange(T)):
        raise TraceError(f"{where}: array 'step' does not count the steps 0..{T - 1}")
    within("kind", a["kind"], 0, len(header["kinds"]) - 1)
    _check_offsets(where, "token_offsets", a["token_offsets"], T, N)
    _check_offsets(where, "event_offsets", a["event_offsets"], T, E)
    if np.any(np.diff(a["token_offsets"]) < 1):
        raise TraceError(f"{where}: array 'token_offsets' has a step that fed no token")
    for f in step_record.TABLE.fields:  # the ranges the record's field table declares
        limits = f.limits(sizes)
        if limits is not None and f.name in a:
            within(f.name, a[f.name], *limits)
    _check_block_tables(where, a["block_tables"])
    for name, array in a.items():
        if array.dtype == np.bool_:
            within(name, array.view(np.uint8), 0, 1)
    within("event_kind", a["event_kind"], 0, len(header["event_kinds"]) - 1)
    for name in ("event_policy", "event_reason"):
        within(name, a[name], 0, len(header["strings"]) - 1)
    for column, bounds in step_record.EVENT_BOUNDS.items():  # the ranges the record's table declares
        if f"event_{column}" in a:  # (frame: version 2; seq: version 3)
            low, high = bound_limits(bounds, sizes)
            whole = column in ("layer", "page") and header["version"] < 3  # no sequence events before version 3
            within(f"event_{column}", a[f"event_{column}"], 0 if whole else low, high)
    if "event_detail" in a:
        _check_details(a["event_kind"], a["event_detail"], header, sizes, where)
    if header["version"] >= 2:
        within("has_tiers", a["has_tiers"].view(np.uint8), 0, 1)
        if np.any(a["has_tiers"] != (sizes["D"] > 0)):  # the writer records tiers on every step or none
            raise TraceError(f"{where}: array 'has_tiers' disagrees with page_map_pages = {sizes['D']} (a disk tier "
                             "or page selection records its tiers on every step, and only then)")
        within("tier_counts", a["tier_counts"], 0, 2**62)
        within("page_maps", a["page_maps"], -1, max(N - 1, 0))
        within("block_frames", a["block_frames"], -1, P - 1)
        recall = a["recall"][~np.isnan(a["recall"])]
        if recall.size and (recall.min() < 0 or recall.max() > 1.01):
            raise TraceError(f"{where}: array 'recall' holds shares outside [0, 1]")
    if header["version"] >= 4:
        lost = a["oracle_lost_by_head"][~np.isnan(a["oracle_lost_by_head"])]
        if lost.size and (lost.min() < 0 or lost.max() > 1.01):
            raise TraceError(f"{where}: array 'oracle_lost_by_head' holds shares outside [0, 1]")
    attention = a["attention"]
    for start in range(0, T, 64):  # in slices: a whole-array temporary would double the memory
        part = attention[start: start + 64]
        if not np.all((part >= 0) & (part <= 1)):  # also false for NaN
            raise TraceError(f"{where}: array 'attention' holds weights outside [0, 1] at step {start} or after")


def _check_details(kinds: np.ndarray, details: np.ndarray, header: dict, sizes: dict[str, int], where: str) -> None:
    """Each event's detail within the range its kind allows (step_record.DETAIL_BOUNDS)."""
    layout = header.get("kv_layout") or {}
    sizes = {**sizes, "KV": layout.get("n_kv_heads") or sizes["H"] or MAX_HEADS}
    for index, name in enumerate(header["event_kinds"]):
        bounds = step_record.DETAIL_BOUNDS.get(name, step_record.NO_DETAIL)
        if bounds is None:
            continue
        low, high = bound_limits(bounds[:2], sizes)
        of_kind = details[kinds == index]
        bad = of_kind[(of_kind < low) | (of_kind > high)]
        if bad.size:
            raise TraceError(f"{where}: array 'event_detail' holds {bad[0]} for a {name!r} event, outside "
                             f"{low}..{high} ({bounds[2]})")


# --- helpers ---------------------------------------------------------------------------------------

def config_from_dict(data: dict) -> SessionConfig:
    """A trace header's `config` as the session configuration it describes (the settings table's names)."""
    return settings.from_dict(data, SessionConfig())


def _check_type(value: Any, kind: str, key: str, where: str) -> None:
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    base, _, item = kind.partition("[")
    item = item.rstrip("]")
    ok = _is(value, base) and (
        not item or all(_is(v, item) for v in (value.values() if base == "dict" else value)))
    if not ok:
        raise TraceError(f"{where}: header.json {key} is {_describe(value)}, expected {_spell(kind)}")


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "dict": dict, "list": list, "bool": bool}[kind])


def _spell(kind: str) -> str:
    base, _, item = kind.partition("[")
    names = {"int": "an integer", "str": "a string", "dict": "an object", "list": "a list", "bool": "true or false",
             "number": "a number"}
    if item:
        plural = {"int": "integers", "str": "strings"}[item.rstrip("]")]
        return f"a list of {plural}" if base == "list" else f"an object of {plural}"
    return names[base]


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:40] + '…'}"


def _declared(listed: dict, name: str, where: str) -> tuple[str, tuple[int, ...]]:
    spec = listed.get(name)
    ok = (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and isinstance(spec.get("shape"), list)
          and all(_is(d, "int") and d >= 0 for d in spec["shape"]))
    if not ok:
        raise TraceError(f"{where}: header.json arrays.{name} must be {{'dtype': string, 'shape': list of sizes}}")
    return spec["dtype"], tuple(spec["shape"])


def _check_tables(header: dict, sizes: dict[str, int], where: str) -> None:
    def unknown(key: str, known) -> None:
        bad = [v for v in header[key] if v not in known]
        if bad:
            raise TraceError(f"{where}: header.json {key} holds {bad[0]!r}; known: {', '.join(map(str, known))}")

    unknown("kinds", KINDS)
    unknown("event_kinds", event_kinds_of_version(header["version"]))
    if tuple(header["oracle_columns"]) != ORACLE_COLUMNS:
        raise TraceError(f"{where}: header.json oracle_columns must be {list(ORACLE_COLUMNS)}")
    delta = delta_encoded(header["version"])
    if sorted(header["delta_encoded"]) != sorted(delta):
        raise TraceError(f"{where}: header.json delta_encoded must be {delta}")
    if len(set(header["timing_keys"])) != len(header["timing_keys"]):
        raise TraceError(f"{where}: header.json timing_keys repeats a key")
    if len(header["next_texts"]) != sizes["T"]:
        raise TraceError(f"{where}: header.json has {len(header['next_texts'])} next_texts for {sizes['T']} steps")
    for layer in header["attention_layers"]:
        if not 0 <= layer < sizes["L"]:
            raise TraceError(f"{where}: header.json attention_layers holds {layer}; the trace has layers "
                             f"0..{sizes['L'] - 1}")
    if bool(header["attention_layers"]) != (sizes["H"] > 0):
        raise TraceError(f"{where}: header.json n_heads = {sizes['H']} does not fit attention_layers "
                         f"{header['attention_layers']} (heads are 0 exactly when no layer is recorded)")
    if not header["prompt_ids"]:
        raise TraceError(f"{where}: header.json prompt_ids is empty")
    for token in header["prompt_ids"]:
        if not 0 <= token <= MAX_TOKEN_ID:
            raise TraceError(f"{where}: header.json prompt_ids holds {token}, not a token id")
    for key in header["token_texts"]:
        if not (key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise TraceError(f"{where}: header.json token_texts has key {key[:40]!r}, not a token id")


def _check_config(header: dict, sizes: dict[str, int], where: str) -> None:
    data = header["config"]
    known = {f.name for f in dataclasses.fields(SessionConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TraceError(f"{where}: header.json config has unknown setting {unknown[0]!r}")
    for key, kind in CONFIG_TYPES.items():
        if key in data:
            _check_type(data[key], kind, f"config.{key}", where)
    for key, size in (("page_size", "S"), ("max_pages", "P")):
        if data.get(key) != sizes[size]:
            raise TraceError(f"{where}: header.json config.{key} = {data.get(key)!r} but the arrays have "
                             f"{key} {sizes[size]}")
    if data.get("dtype", "float32") not in STORAGE_DTYPES:
        raise TraceError(f"{where}: header.json config.dtype = {data['dtype']!r}; known: {', '.join(STORAGE_DTYPES)}")
    if data.get("policy") not in POLICIES:
        raise TraceError(f"{where}: header.json config.policy = {data.get('policy')!r} is not a policy of this "
                         f"pagevis ({', '.join(POLICIES)})")
    for key, value in (data.get("policy_params") or {}).items():
        if not (value is None or isinstance(value, (int, float, str))):
            raise TraceError(f"{where}: header.json config.policy_params.{key} is {_describe(value)}, "
                             "expected a number, a string or null")
    sampling = data.get("sampling", {})
    known_sampling = {f.name for f in dataclasses.fields(SamplingConfig)}
    if set(sampling) - known_sampling:
        raise TraceError(f"{where}: header.json config.sampling has unknown setting "
                         f"{sorted(set(sampling) - known_sampling)[0]!r}")
    record_layers = data.get("record_layers")
    if record_layers is not None:
        _check_type(record_layers, "list[int]", "config.record_layers", where)
        if list(record_layers) != header["attention_layers"]:
            raise TraceError(f"{where}: header.json config.record_layers {record_layers} differs from "
                             f"attention_layers {header['attention_layers']}")
    elif header["attention_layers"] != list(range(sizes["L"])):
        raise TraceError(f"{where}: header.json config.record_layers is null (all layers) but attention_layers "
                         f"is {header['attention_layers']}")
    try:
        config = config_from_dict(data)
        config.check()
        if config.n_page_ids != sizes["B"]:
            raise TraceError(f"{where}: header.json config holds {config.n_page_ids} pages per layer but "
                             f"n_page_ids is {sizes['B']}")
    except ConfigError as error:
        raise TraceError(f"{where}: header.json config: {error}") from None
    except (TypeError, ValueError) as error:  # a policy parameter of the wrong type
        raise TraceError(f"{where}: header.json config is not a valid session configuration ({error})") from None


def _check_model(header: dict, sizes: dict[str, int], where: str) -> None:
    model = header["model"]
    if model is None:
        return
    fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    for key, value in model.items():
        if key not in fields:
            raise TraceError(f"{where}: header.json model has unknown field {key!r}")
        kind = "str?" if key in ("kind", "path") else "int"
        _check_type(value, kind, f"model.{key}", where)
    try:
        spec = ModelSpec(**model)
    except ConfigError as error:
        raise TraceError(f"{where}: header.json model: {error}") from None
    if spec.kind == "synthetic" and spec.n_layers != sizes["L"]:
        raise TraceError(f"{where}: header.json model has {spec.n_layers} layers but the arrays have {sizes['L']}")


def _check_offsets(where: str, key: str, offsets: np.ndarray, n_steps: int, total: int) -> None:
    if len(offsets) != n_steps + 1 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
        raise TraceError(f"{where}: array {key!r} does not index its {total} entries over {n_steps} steps")


def _check_block_tables(where: str, tables: np.ndarray) -> None:
    """Per step and layer: page ids first, then -1 padding; no page twice."""
    used = tables >= 0
    if np.any(used[..., 1:] & ~used[..., :-1]):
        raise TraceError(f"{where}: array 'block_tables' has a page after the -1 padding")
    ordered = np.sort(tables, axis=-1)
    if np.any((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)):
        raise TraceError(f"{where}: array 'block_tables' lists a page twice in one layer's table")

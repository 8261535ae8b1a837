"""Fuzzing the file readers with hypothesis: valid traces and GGUF files, mutated (byte flips, truncations, header
fields of the wrong type or size, huge declared sizes), are either read (and a replay timeline builds from them)
or refused with one TraceError / ModelLoadError naming the file; nothing else escapes, memory stays bounded.
A few mutated files also go through the CLI in a subprocess limited to 1.5 GiB of address space.

Bounded: a fixed number of examples per test, no shrinking past a few seconds (the suite takes ~10 s).
"""

from __future__ import annotations

import pytest
import functools
import io
import json
import os
import resource
import struct
import zipfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagevis.errors import ConfigError
from pagevis.viewmodel.timeline import timeline_from_trace
from pagevis.model import ModelLoadError, load_model
from pagevis.trace import TraceError, read_trace

from model_fixtures import write_llama_gguf
from test_hostile_files import assert_one_line_refusal, run_cli

VALID_TRACE = Path(__file__).parent / "data" / "hostile" / "valid.pvtrace"
FUZZ = settings(max_examples=int(os.environ.get("PAGEVIS_FUZZ_EXAMPLES", 120)), deadline=None,
                derandomize=not os.environ.get("PAGEVIS_FUZZ_EXAMPLES"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ODD_VALUES = st.sampled_from([None, True, False, -1, 0, 1, 2**31, 2**40, 10**12, -(2**63), 1.5, float("1e308"),
                              "", "x", "float8", [], [-1], [2**40], ["a"], {}, {"dtype": "<f8", "shape": [2**40]},
                              [[[[[]]]]]])
HUGE = st.sampled_from([2**31 - 1, 2**32 - 1, 2**40, 2**62, 2**64 - 1])


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _disk_tier_trace() -> bytes:
    """A format-version-2 trace with a disk tier (swap_out / fault_in events, tier arrays), written now."""
    import tempfile

    from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
    from pagevis.trace import write_trace

    spec = ModelSpec(kind="synthetic", n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, seed=1)
    config = SessionConfig(page_size=4, max_pages=2, disk_pages=4, policy="sinks", max_new_tokens=10, chat=False)
    session = DecodeSession(spec.load(), "pages of keys and values", config)
    for _ in session.run():
        pass
    with tempfile.TemporaryDirectory() as folder:
        write_trace(Path(folder) / "v2.pvtrace", session, model_spec=spec)
        return (Path(folder) / "v2.pvtrace").read_bytes()


def _members(raw: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


# Every test mutates the shipped version-1 trace (old files must keep opening safely), one with a disk tier, or
# one with kvzip's events (mask per KV head, reconstruct; details whose range depends on their kind).
VALID = {"v1": VALID_TRACE.read_bytes(), "v2": _disk_tier_trace(),
         "v4-kvzip": (VALID_TRACE.parent / "valid-kvzip.pvtrace").read_bytes()}
VALID_MEMBERS = {version: _members(raw) for version, raw in VALID.items()}
VERSIONS = st.sampled_from(sorted(VALID))


def zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def check_trace(path: Path) -> None:
    """The reader's contract: a Trace whose replay timeline builds and whose HTML page stays within a size set by
    the trace's own steps and events, or one TraceError line naming the file."""
    from pagevis.export.html import write_html

    try:
        trace = read_trace(path)
    except TraceError as refused:
        message = str(refused)
        assert message.startswith(f"{path}:") and "\n" not in message, message
        return
    timeline = timeline_from_trace(trace)  # what the app's replay builds: must not raise
    events = sum(len(r.events) for r in trace.records)
    size = write_html(path.with_suffix(".html"), timeline, 0)  # the narration included
    assert size < (256 << 10) + (16 << 10) * len(trace.records) + 512 * events, (size, len(trace.records), events)


@FUZZ
@given(data=st.data())
def test_byte_flips_and_truncations_of_a_trace(tmp_path_factory, data):
    raw = bytearray(VALID[data.draw(VERSIONS, label="version")])
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))), label="cut")
    path = tmp_path_factory.mktemp("flip") / "t.pvtrace"
    path.write_bytes(bytes(raw[:cut]))
    before = peak_rss()
    check_trace(path)
    assert peak_rss() - before < 256 << 20


def header_paths(header: dict) -> list[tuple[str, ...]]:
    paths = [(key,) for key in header]
    paths += [("config", key) for key in header["config"]]
    paths += [("config", "sampling", key) for key in header["config"]["sampling"]]
    paths += [("arrays", key) for key in header["arrays"]]
    paths += [("arrays", key, "shape") for key in header["arrays"]]
    paths += [("model", key) for key in header["model"]]
    return paths


HEADER_PATHS = sorted({path for members in VALID_MEMBERS.values()
                       for path in header_paths(json.loads(members["header.json"]))})


@FUZZ
@given(data=st.data())
def test_header_fields_of_the_wrong_type_or_size(tmp_path_factory, data):
    members = VALID_MEMBERS[data.draw(VERSIONS, label="version")]
    header = json.loads(members["header.json"])
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        path = data.draw(st.sampled_from(HEADER_PATHS), label="field")
        target = header
        for key in path[:-1]:
            target = target[key] if isinstance(target, dict) and isinstance(target.get(key), dict) else None
            if target is None:
                break
        if target is not None:
            if data.draw(st.booleans(), label="delete"):
                target.pop(path[-1], None)
            else:
                target[path[-1]] = data.draw(ODD_VALUES, label="value")
    path = tmp_path_factory.mktemp("header") / "t.pvtrace"
    path.write_bytes(zip_of({**members, "header.json": json.dumps(header).encode()}))
    check_trace(path)


@FUZZ
@given(data=st.data())
def test_array_values_at_their_extremes(tmp_path_factory, data):
    members = VALID_MEMBERS[data.draw(VERSIONS, label="version")]
    name = data.draw(st.sampled_from(sorted(n for n in members if n.endswith(".npy"))), label="array")
    array = np.lib.format.read_array(io.BytesIO(members[name]), allow_pickle=False).copy()
    if array.size:
        flat = array.reshape(-1)
        info = np.iinfo(array.dtype) if array.dtype.kind in "iu" else None
        choices = [-1, 0, 1] + ([info.min, info.max] if info else [np.nan, np.inf, -np.inf, 1e30])
        if array.dtype.kind == "b":
            choices = [0, 1]
            flat = flat.view(np.uint8)
            choices += [2, 255]
        at = data.draw(st.integers(0, flat.size - 1), label="at")
        value = data.draw(st.sampled_from(choices), label="value")
        with np.errstate(invalid="ignore", over="ignore"):
            flat[at] = np.array(value).astype(flat.dtype) if array.dtype.kind in "iub" else value
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    path = tmp_path_factory.mktemp("array") / "t.pvtrace"
    path.write_bytes(zip_of({**members, name: buffer.getvalue()}))
    check_trace(path)


@FUZZ
@given(data=st.data())
def test_huge_declared_sizes_in_zip_and_npy_headers(tmp_path_factory, data):
    version = data.draw(VERSIONS, label="version")
    raw_trace, members = VALID[version], VALID_MEMBERS[version]
    name = data.draw(st.sampled_from(sorted(members)), label="member")
    if data.draw(st.booleans(), label="zip"):
        raw = bytearray(raw_trace)
        with zipfile.ZipFile(io.BytesIO(raw_trace)) as archive:
            info = archive.getinfo(name)
        directory = struct.unpack_from("<L", raw, len(raw) - 22 + 16)[0]
        at = raw.index(b"PK\x01\x02", directory)
        while raw[at + 46: at + 46 + len(name)] != name.encode():
            at = raw.index(b"PK\x01\x02", at + 4)
        field = data.draw(st.sampled_from([20, 24]), label="size field")  # compressed / uncompressed
        struct.pack_into("<L", raw, at + field, data.draw(HUGE, label="size") & 0xFFFFFFFF)
        struct.pack_into("<L", raw, info.header_offset + field - 2, 0xFFFFFFFF)
        blob = bytes(raw)
    else:
        member = members[name]
        if name.endswith(".npy"):
            shape = data.draw(st.lists(HUGE, min_size=1, max_size=3), label="shape")
            member = member.replace(b"'shape': (", b"'shape': (" + ", ".join(map(str, shape)).encode() + b", ", 1)
        else:
            member = member.replace(b'"n_steps": ', b'"n_steps": ' + str(data.draw(HUGE)).encode() + b"0", 1)
        blob = zip_of({**members, name: member})
    path = tmp_path_factory.mktemp("huge") / "t.pvtrace"
    path.write_bytes(blob)
    before = peak_rss()
    check_trace(path)
    assert peak_rss() - before < 256 << 20


DETAIL_VALUES = [-(2**63), -2, -1, 0, 1, 2, 3, 7, 8, 23, 24, 25, 31, 32, 2**31 - 1, 2**31, 10**6, 2**40, 2**63 - 1]


@FUZZ
@given(data=st.data())
def test_event_details_and_sequences_of_every_kind(tmp_path_factory, data):
    """kvzip's trace with one event's detail (or sequence) set to a boundary of some kind's range: refused in one
    line, or replayed and exported within the trace's size (engine/step_record.py DETAIL_BOUNDS declares the ranges)."""
    members = VALID_MEMBERS["v4-kvzip"]
    column = data.draw(st.sampled_from(["event_detail", "event_seq"]), label="column")
    array = np.lib.format.read_array(io.BytesIO(members[f"{column}.npy"]), allow_pickle=False).copy()
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        at = data.draw(st.integers(0, array.size - 1), label="event")
        value = data.draw(st.sampled_from(DETAIL_VALUES), label="value")
        with np.errstate(over="ignore"):
            array[at] = np.array(value).astype(array.dtype)
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    path = tmp_path_factory.mktemp("detail") / "t.pvtrace"
    path.write_bytes(zip_of({**members, f"{column}.npy": buffer.getvalue()}))
    before = peak_rss()
    check_trace(path)
    assert peak_rss() - before < 256 << 20


# --- GGUF ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def gguf_bytes() -> bytes:
    """A small valid Llama GGUF (one layer, random weights, byte-level vocabulary)."""
    import tempfile

    from pagevis.model.synthetic import SyntheticModel

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "small.gguf"
        write_llama_gguf(path, SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, seed=5))
        return path.read_bytes()


@functools.lru_cache(maxsize=1)
def loaded_once() -> None:
    """The valid file loaded once before any mutation is measured: what a first load does once a process (the
    kernels it imports, compiled in memory when another process holds their compile lock: ~650 MB of LLVM's on a
    clean clone here) is not a mutated header's allocation."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "small.gguf"
        path.write_bytes(gguf_bytes())
        load_model(path)


def header_size(raw: bytes, folder: Path) -> int:
    """Bytes before the tensor data: header, metadata and tensor table."""
    from pagevis.model.gguf_header import check_gguf_structure

    (folder / "valid.gguf").write_bytes(raw)
    return check_gguf_structure(folder / "valid.gguf")


def check_model(path: Path) -> None:
    try:
        load_model(path)
    except ModelLoadError as refused:
        message = str(refused)
        assert str(path) in message and "\n" not in message, message
    except ConfigError as refused:  # a setting out of range: the CLI names it in one line too
        assert "\n" not in str(refused)


@FUZZ
@given(data=st.data())
def test_gguf_header_mutations(tmp_path_factory, data):
    raw = bytearray(gguf_bytes())
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    end = header_size(gguf_bytes(), path.parent)
    kind = data.draw(st.sampled_from(["flip", "huge count", "truncate"]), label="kind")
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 6), label="flips")):
            raw[data.draw(st.integers(0, end - 1), label="at")] ^= data.draw(st.integers(1, 255), label="xor")
    elif kind == "huge count":
        at = data.draw(st.integers(4, end - 8), label="at")
        struct.pack_into("<Q", raw, at, data.draw(HUGE, label="value"))
    else:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")]
    path.write_bytes(bytes(raw))
    loaded_once()
    before = peak_rss()
    check_model(path)
    assert peak_rss() - before < 256 << 20


ROPE_KEYS = ["llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scale_linear",
             "llama.rope.scaling.attn_factor"]
ROPE_VALUES = st.sampled_from(["none", "linear", "yarn", "longrope", "dynamic", "", "LINEAR", 0.0, 1.0, 8.0, -1.0,
                               0.5, 1e-30, 1e30, float("nan"), float("inf"), float("-inf"), 3, "8"])
SCALES = {"yarn", "longrope"}


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 40))
@given(data=st.data())
def test_rope_scaling_metadata_is_honoured_or_refused_by_its_key(tmp_path_factory, data):
    """Any value of the RoPE scaling keys: the model loads with the factor llama.cpp would read (and its forward
    pass stays finite), or the load is refused in one line naming a RoPE key and the file once."""
    from pagevis.model import DenseAttention
    from pagevis.model.synthetic import SyntheticModel

    overrides = {key: data.draw(ROPE_VALUES, label=key) for key in ROPE_KEYS if data.draw(st.booleans(), label=key)}
    path = tmp_path_factory.mktemp("rope") / "m.gguf"
    write_llama_gguf(path, SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, seed=5),
                     metadata_overrides=overrides)
    try:
        model = load_model(path)
    except ModelLoadError as refused:
        message = str(refused)
        assert message.count(str(path)) == 1 and "\n" not in message and "rope" in message, message
        return
    kind = overrides.get("llama.rope.scaling.type", "linear")
    factor = overrides.get("llama.rope.scaling.factor", overrides.get("llama.rope.scale_linear", 0.0))
    expected = 1.0 if kind == "none" or factor == 0 else float(np.float32(factor))
    assert kind in ("none", "linear") and model.config.rope_scale == expected
    logits = model.forward(np.arange(6), np.arange(6) * 1000, DenseAttention(model.config))
    assert np.isfinite(logits).all()


SPM_BYTES = st.sampled_from([(), tuple(range(0x80)), tuple(range(256)), tuple(range(0xC0)) + tuple(range(0xC2, 0xF5)),
                             tuple(b for b in range(256) if b not in (0x20, 0x41)), tuple(range(1, 256))])


@settings(FUZZ, max_examples=min(FUZZ.max_examples, 30))
@given(data=st.data())
def test_a_sentencepiece_vocabulary_never_drops_a_character(tmp_path_factory, data):
    """With or without <unk>, with some byte tokens or none: the file is refused at load in one line, or every
    text round-trips (a character it cannot spell showing as <unk>, never vanishing)."""
    from pagevis.model.synthetic import SyntheticModel

    byte_values, unknown = data.draw(SPM_BYTES, label="bytes"), data.draw(st.booleans(), label="unk")
    pieces = ["▁", "t", "h", "e", "▁the", "A", "é"]
    pieces += [f"<filler{i}>" for i in range(max(0, 256 - 3 - unknown - len(byte_values) - len(pieces)))]
    folder = tmp_path_factory.mktemp("spm")
    path = write_llama_gguf(folder / "m.gguf", SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                                                              vocab_size=3 + unknown + len(byte_values) + len(pieces)),
                            sentencepiece=pieces, spm_bytes=byte_values, spm_unknown=unknown)
    os.environ["PAGEVIS_CACHE_DIR"] = str(folder / "cache")
    try:
        tokenizer = load_model(path).tokenizer
    except ModelLoadError as refused:
        message = str(refused)
        assert not unknown and message.count(str(path)) == 1 and "\n" not in message, message
        return
    finally:
        del os.environ["PAGEVIS_CACHE_DIR"]
    text = data.draw(st.text(st.characters(codec="utf-8"), max_size=12), label="text")
    back = tokenizer.decode(tokenizer.encode(text), skip_special=True)
    assert back == text or (unknown and "<unk>" in back), (text, back)


# --- through the CLI, memory-limited ------------------------------------------------------------------

@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.slow
@given(data=st.data())
def test_cli_on_mutated_files_is_one_line_in_bounded_memory(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("cli")
    trace = bytearray(VALID[data.draw(VERSIONS, label="version")])
    at = data.draw(st.integers(0, len(trace) - 23), label="trace at")
    trace[at: at + 4] = b"\xff\xff\xff\x7f"
    (folder / "t.pvtrace").write_bytes(bytes(trace))
    result = run_cli("replay", "--check", str(folder / "t.pvtrace"))
    if result.returncode != 0:  # a flip in a value nobody checks (e.g. a timing) may leave a valid trace
        assert_one_line_refusal(result, "t.pvtrace")
    model = bytearray(gguf_bytes())
    struct.pack_into("<Q", model, data.draw(st.integers(8, 200), label="gguf at"), 2**40)
    (folder / "m.gguf").write_bytes(bytes(model))
    result = run_cli("run", "--model", str(folder / "m.gguf"), "--max-tokens", "1", "--quiet")
    if result.returncode != 0:
        assert_one_line_refusal(result, "m.gguf")

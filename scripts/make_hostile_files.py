"""Write the hostile trace and GGUF files of issue #8 to tests/data/hostile/ (small files; run from the repo root).

    .venv/bin/python scripts/make_hostile_files.py          (adds the files tests/data/hostile/ lacks)
    .venv/bin/python scripts/make_hostile_files.py --all    (rewrites every file with today's trace writer)

Each file is one crafted case: a zip bomb (1.5 GiB of zeros as a ~1.5 MB deflate stream), an `.npy` member
that declares 10**12 elements, encrypted / unknown-compression / non-UTF-8 zip entries, header.json entries
of the wrong type or out of range or inconsistent with the arrays, a deeply nested header, GGUF files whose
header claims 2**40-element arrays or 10**9 layers, and small GGUF models with no tokenizer, no byte tokens
or a metadata value of the wrong type (issue #8). Issue #36 added: events whose detail (a mask event's KV head,
...) is out of the range its kind allows, on a kvzip trace (valid-kvzip.pvtrace, the uncorrupted one); RoPE
scaling llama.cpp reads but pagevis does not compute, or out of range; SentencePiece vocabularies that would
lose characters; small models whose chat template is a bomb or cannot be split
(template-*.gguf, checked by tests/test_hostile_templates.py). tests/test_hostile_files.py expects every one of them to be refused
with one line (exit status 2). `MANIFEST` (written next to them) says what each file is.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "hostile"
sys.path.insert(0, str(ROOT / "tests"))

BOMB_BYTES = 3 << 29  # 1.5 GiB


# --- a valid trace to mutate --------------------------------------------------------------------------

def base_trace(path: Path) -> Path:
    from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
    from pagevis.trace import write_trace

    spec = ModelSpec(kind="synthetic", n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, seed=1)
    config = SessionConfig(page_size=4, max_pages=2, policy="h2o", max_new_tokens=6, chat=False)
    session = DecodeSession(spec.load(), "pages of keys", config)
    for record in session.run():
        record.timings.update({key: 0.001 for key in record.timings})  # the same bytes on every run
    write_trace(path, session, model_spec=spec, meta={"command": "make_hostile_files.py"})
    header, arrays = members(path)
    write_zip(path, header, arrays)  # fixed member dates
    return path


def kvzip_trace(path: Path) -> Path:
    """A trace with the newest event kinds (kvzip: reconstruct, mask per KV head; the prefix cache: store,
    uncache), whose event_detail columns the event cases below corrupt."""
    from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
    from pagevis.trace import write_trace

    spec = ModelSpec(kind="synthetic", n_layers=2, n_heads=2, n_kv_heads=2, head_dim=8, seed=1)
    config = SessionConfig(page_size=4, max_pages=8, policy="kvzip", max_new_tokens=4, chat=False)
    session = DecodeSession(spec.load(), "pages of keys and values", config)
    for record in session.run():
        record.timings.update({key: 0.001 for key in record.timings})
    write_trace(path, session, model_spec=spec, meta={"command": "make_hostile_files.py"})
    header, arrays = members(path)
    write_zip(path, header, arrays)  # fixed member dates
    return path


def members(path: Path) -> tuple[dict, dict[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        raw = {name: archive.read(name) for name in archive.namelist()}
    return json.loads(raw.pop("header.json")), raw


def write_zip(path: Path, header, arrays: dict[str, bytes], header_text: str | None = None) -> None:
    def member(name: str) -> zipfile.ZipInfo:  # a fixed date: the files are the same bytes on every run
        info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        return info

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member("header.json"), header_text if header_text is not None else json.dumps(header))
        for name, data in arrays.items():
            archive.writestr(member(name), data)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)


def mutate(base: Path, out: Path, header_change=None, array_changes: dict | None = None) -> None:
    header, arrays = members(base)
    if header_change:
        header_change(header)
    for name, change in (array_changes or {}).items():
        array = load_npy(arrays[name]).copy()
        arrays[name] = npy_bytes(change(array))
    write_zip(out, header, arrays)


def deflate_zeros(total: int, byte: bytes = b"\0") -> tuple[bytes, int]:
    """A raw deflate stream of `total` copies of `byte`, and its CRC-32."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = byte * (1 << 20)
    parts, crc, left = [], 0, total
    while left:
        piece = chunk[: min(left, len(chunk))]
        parts.append(packer.compress(piece))
        crc = zlib.crc32(piece, crc)
        left -= len(piece)
    parts.append(packer.flush())
    return b"".join(parts), crc


def raw_zip(entries: list[tuple[bytes, bytes, int, int, int, int]]) -> bytes:
    """A zip from (name, stored data, method, crc, uncompressed size, flags) with honest offsets."""
    body, directory = b"", b""
    for name, data, method, crc, size, flags in entries:
        local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, flags, method, 0, 0x21, crc, len(data), size,
                            len(name), 0)
        directory += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, flags, method, 0, 0x21, crc, len(data),
                                 size, len(name), 0, 0, 0, 0, 0, len(body)) + name
        body += local + name + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(directory), len(body), 0)
    return body + directory + end


def patch_central(data: bytes, member: str, flags: int | None = None, method: int | None = None,
                  name: bytes | None = None) -> bytes:
    """Change one member's flags, method or name in both its local header and the central directory."""
    data = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.getinfo(member)
    at = struct.unpack_from("<L", data, len(data) - 22 + 16)[0]  # the end record's central directory offset
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46: at + 46 + name_len]) == member.encode():
            break
        extra, comment = struct.unpack_from("<2H", data, at + 30)
        at += 46 + name_len + extra + comment
    local = info.header_offset
    for header, flag_at, method_at, name_at in ((at, 8, 10, 46), (local, 6, 8, 30)):
        if flags is not None:
            struct.pack_into("<H", data, header + flag_at, flags)
        if method is not None:
            struct.pack_into("<H", data, header + method_at, method)
        if name is not None:
            data[header + name_at: header + name_at + len(name)] = name
    return bytes(data)


# --- the cases ------------------------------------------------------------------------------------------

def trace_cases(base: Path) -> dict[str, str]:
    made = {}

    def case(name: str, what: str) -> Path:
        made[name] = what
        return OUT / name

    header, arrays = members(base)

    # Size caps
    stream, crc = deflate_zeros(BOMB_BYTES)
    case("bomb-member.pvtrace", "attention.npy inflates to 1.5 GiB (honest declared size), a 1.5 MB file")
    entries = [(b"header.json", zlib.compress(json.dumps(header).encode())[2:-4], 8,
                zlib.crc32(json.dumps(header).encode()), len(json.dumps(header).encode()), 0)]
    entries += [(n.encode(), zlib.compress(d)[2:-4], 8, zlib.crc32(d), len(d), 0) for n, d in arrays.items()
                if n != "attention.npy"]
    entries.append((b"attention.npy", stream, 8, crc, BOMB_BYTES, 0))
    (OUT / "bomb-member.pvtrace").write_bytes(raw_zip(entries))

    small, small_crc = deflate_zeros(64 << 20)
    case("bomb-lying-size.pvtrace", "attention.npy declares its true size but inflates to 64 MiB")
    true_size = len(arrays["attention.npy"])
    entries[-1] = (b"attention.npy", small, 8, small_crc, true_size, 0)
    (OUT / "bomb-lying-size.pvtrace").write_bytes(raw_zip(entries))

    spaces, spaces_crc = deflate_zeros(1 << 30, b" ")
    case("bomb-header.pvtrace", "header.json inflates to 1 GiB of spaces")
    (OUT / "bomb-header.pvtrace").write_bytes(raw_zip([(b"header.json", spaces, 8, spaces_crc, 1 << 30, 0)]))

    case("npy-huge-shape.pvtrace", "event_score.npy's .npy header declares shape (10**12,)")
    forged = bytearray(npy_bytes(np.zeros(3)))
    head_end = forged.index(b"\n") + 1
    text = forged[10:head_end].decode("latin1").replace("(3,)", f"({10**12},)")
    text = text[:-1].ljust(head_end - 10 - 1) + "\n"
    forged[10:head_end] = text.encode("latin1")
    write_zip(OUT / "npy-huge-shape.pvtrace", header, {**arrays, "event_score.npy": bytes(forged)})

    case("header-huge-shape.pvtrace", "header.json declares event_score of 10**12 elements")
    mutate(base, OUT / "header-huge-shape.pvtrace",
           lambda h: h["arrays"].update(event_score={"dtype": "<f8", "shape": [10**12]}))

    case("many-members.pvtrace", "a zip of 300 empty members")
    (OUT / "many-members.pvtrace").write_bytes(raw_zip([(f"m{i}".encode(), b"", 0, 0, 0, 0) for i in range(300)]))

    # Zip entries that zipfile itself raises on
    valid = base.read_bytes()
    case("encrypted.pvtrace", "slot_maps.npy has the encrypted flag")
    (OUT / "encrypted.pvtrace").write_bytes(patch_central(valid, "slot_maps.npy", flags=0x1))
    case("compression-99.pvtrace", "scores.npy has compression method 99")
    (OUT / "compression-99.pvtrace").write_bytes(patch_central(valid, "scores.npy", method=99))
    case("bad-utf8-name.pvtrace", "a member name that is not UTF-8 while the UTF-8 flag is set")
    (OUT / "bad-utf8-name.pvtrace").write_bytes(patch_central(valid, "step.npy", flags=0x800,
                                                              name=b"\xff\xfe\xfd\xfc.npy"))

    # header.json of the wrong type, out of range, inconsistent
    def header_case(name: str, what: str, change) -> None:
        case(name, what)
        mutate(base, OUT / name, change)

    header_case("arrays-entry-int.pvtrace", "an arrays entry that is an int", lambda h: h["arrays"].update(step=5))
    header_case("version-true.pvtrace", "version: true", lambda h: h.update(version=True))
    header_case("negative-page-size.pvtrace", "page_size -4 (header and config)",
                lambda h: (h.update(page_size=-4), h["config"].update(page_size=-4)))
    header_case("config-disagrees.pvtrace", "config.max_pages 99, the arrays have 2",
                lambda h: h["config"].update(max_pages=99))
    header_case("unknown-policy.pvtrace", "config.policy 'lru-9000'", lambda h: h["config"].update(policy="lru-9000"))
    header_case("attention-layer-out-of-range.pvtrace", "attention_layers [0, 7] in a 2-layer trace",
                lambda h: (h.update(attention_layers=[0, 7]), h["config"].update(record_layers=[0, 7])))
    header_case("bogus-dtype.pvtrace", "config.dtype 'float8'", lambda h: h["config"].update(dtype="float8"))
    header_case("record-layers-strings.pvtrace", "config.record_layers ['a']",
                lambda h: h["config"].update(record_layers=["a"]))
    header_case("prompt-ids-strings.pvtrace", "prompt_ids as strings",
                lambda h: h.update(prompt_ids=[str(t) for t in h["prompt_ids"]]))
    header_case("n-heads-string.pvtrace", "n_heads '2'", lambda h: h.update(n_heads="2"))
    header_case("sampling-temperature-string.pvtrace", "config.sampling.temperature 'hot'",
                lambda h: h["config"]["sampling"].update(temperature="hot"))
    header_case("model-layers-disagree.pvtrace", "model.n_layers 10**9",
                lambda h: h["model"].update(n_layers=10**9))
    header_case("unknown-event-kind.pvtrace", "event_kinds ['allocate', 'explode']",
                lambda h: h.update(event_kinds=["allocate", "explode"]))
    header_case("many-events.pvtrace", "8 million events declared: few bytes as arrays, gigabytes as Python objects",
                lambda h: h["arrays"].update({name: {"dtype": spec["dtype"], "shape": [8_000_000]}
                                              for name, spec in h["arrays"].items() if name.startswith("event_")
                                              and name != "event_offsets"}))
    header_case("steps-mismatch.pvtrace", "n_steps one more than the arrays hold",
                lambda h: h.update(n_steps=h["n_steps"] + 1))
    case("header-list.pvtrace", "header.json is a JSON list")
    write_zip(OUT / "header-list.pvtrace", None, arrays, header_text="[1, 2, 3]")
    case("deep-nesting.pvtrace", "header.json nested 100 000 lists deep")
    write_zip(OUT / "deep-nesting.pvtrace", None, arrays, header_text="[" * 100_000 + "]" * 100_000)
    case("header-nan.pvtrace", "header.json with NaN for n_steps")
    write_zip(OUT / "header-nan.pvtrace", None, arrays,
              header_text=json.dumps(header).replace(f'"n_steps": {header["n_steps"]}', '"n_steps": NaN'))
    case("header-huge-int.pvtrace", "header.json with a 5000-digit n_steps")
    write_zip(OUT / "header-huge-int.pvtrace", None, arrays,
              header_text=json.dumps(header).replace(f'"n_steps": {header["n_steps"]}', '"n_steps": ' + "9" * 5000))

    # Arrays whose values are out of range
    def array_case(name: str, what: str, member: str, change) -> None:
        case(name, what)
        mutate(base, OUT / name, array_changes={member: change})

    def put(value, at=0):
        def change(array):
            array.reshape(-1)[at] = value
            return array
        return change

    array_case("negative-event-kind.pvtrace", "event_kind -1", "event_kind.npy", put(-1))
    array_case("negative-policy-index.pvtrace", "event_policy -3", "event_policy.npy", put(-3))
    array_case("event-layer-out-of-range.pvtrace", "event_layer 50", "event_layer.npy", put(50))
    array_case("garbage-block-tables.pvtrace", "block_tables 1000 in step 0", "block_tables.npy", put(1000))
    array_case("huge-position.pvtrace", "positions 10**12 (a replay would grow a list to it)", "positions.npy",
               put(10**12, at=-1))
    array_case("huge-slot-position.pvtrace", "slot_maps position 2**30", "slot_maps.npy", put(2**30))
    array_case("kind-index-out-of-range.pvtrace", "kind 7", "kind.npy", put(7))
    array_case("steps-not-counted.pvtrace", "step 0 is 5", "step.npy", put(5))
    array_case("attention-nan.pvtrace", "attention NaN", "attention.npy", put(np.nan))
    array_case("negative-token.pvtrace", "token_ids -5", "token_ids.npy", put(-5))

    case("npy-object-dtype.pvtrace", "token_ids.npy declares dtype object")
    forged = npy_bytes(np.zeros(len(load_npy(arrays["token_ids.npy"])), dtype=np.int64))
    forged = forged.replace(b"'<i8'", b"'|O' ")
    write_zip(OUT / "npy-object-dtype.pvtrace", header, {**arrays, "token_ids.npy": forged})
    case("npy-fortran.pvtrace", "slot_maps.npy in Fortran order")
    forged = arrays["slot_maps.npy"].replace(b"'fortran_order': False", b"'fortran_order': True ")
    write_zip(OUT / "npy-fortran.pvtrace", header, {**arrays, "slot_maps.npy": forged})
    case("npy-truncated.pvtrace", "scores.npy shorter than its header says")
    write_zip(OUT / "npy-truncated.pvtrace", header, {**arrays, "scores.npy": arrays["scores.npy"][:-8]})
    case("npy-pickle.pvtrace", "next_token.npy is a pickle")
    write_zip(OUT / "npy-pickle.pvtrace", header, {**arrays, "next_token.npy": b"\x80\x04\x95" + bytes(40)})
    case("truncated.pvtrace", "the first half of a valid trace")
    (OUT / "truncated.pvtrace").write_bytes(valid[: len(valid) // 2])
    case("empty.pvtrace", "an empty file")
    (OUT / "empty.pvtrace").write_bytes(b"")
    return made


def event_cases(base: Path) -> dict[str, str]:
    """Event columns whose range depends on the event's kind (engine/step_record.py DETAIL_BOUNDS), on a kvzip
    trace."""
    made = {}
    header, arrays = members(base)
    kinds = load_npy(arrays["event_kind.npy"])

    def first(kind: str) -> int:
        return int(np.flatnonzero(kinds == header["event_kinds"].index(kind))[0])

    def detail_case(name: str, what: str, kind: str, value: int, member: str = "event_detail.npy") -> None:
        made[name] = what
        column = load_npy(arrays[member]).copy()
        column[first(kind)] = value
        write_zip(OUT / name, header, {**arrays, member: npy_bytes(column)})

    detail_case("mask-detail-1e6.pvtrace", "a mask event's KV head 10**6 (the narration looped to it)", "mask", 10**6)
    detail_case("mask-detail-2p40.pvtrace", "a mask event's KV head 2**40", "mask", 2**40)
    detail_case("mask-detail-heads.pvtrace", "a mask event's KV head = the trace's KV heads (one past)", "mask", 2)
    detail_case("mask-detail-negative.pvtrace", "a mask event's KV head -1", "mask", -1)
    detail_case("write-detail.pvtrace", "a write event (no detail) with detail 7", "write", 7)
    detail_case("evict-detail-position.pvtrace", "an evict event's merge position 10**9", "evict", 10**9)
    detail_case("reconstruct-detail-negative.pvtrace", "a reconstruct event's fed tokens -5", "reconstruct", -5)
    detail_case("event-seq-negative.pvtrace", "a write event of sequence -1", "write", -1, "event_seq.npy")
    return made


# --- GGUF ---------------------------------------------------------------------------------------------

def gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_cases() -> dict[str, str]:
    made = {}

    def case(name: str, what: str, data: bytes) -> None:
        made[name] = what
        (OUT / name).write_bytes(data)

    head = b"GGUF" + struct.pack("<I", 3)
    case("gguf-array-2p40.gguf", "49 bytes: one metadata array of 2**40 uint8",
         head + struct.pack("<QQ", 0, 1) + gguf_string("a") + struct.pack("<IIQ", 9, 0, 1 << 40))
    case("gguf-tensors-2p60.gguf", "tensor count 2**60", head + struct.pack("<QQ", 1 << 60, 0))
    case("gguf-kv-2p60.gguf", "metadata count 2**60", head + struct.pack("<QQ", 0, 1 << 60))
    case("gguf-key-2p50.gguf", "a key of 2**50 bytes", head + struct.pack("<QQQ", 0, 1, 1 << 50) + b"k")
    case("gguf-string-2p50.gguf", "a string value of 2**50 bytes",
         head + struct.pack("<QQ", 0, 1) + gguf_string("general.name") + struct.pack("<IQ", 8, 1 << 50) + b"x")
    case("gguf-nested-arrays.gguf", "arrays of arrays 10 000 deep",
         head + struct.pack("<QQ", 0, 1) + gguf_string("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10_000)
    case("gguf-bad-type.gguf", "a metadata value of type 77",
         head + struct.pack("<QQ", 0, 1) + gguf_string("a") + struct.pack("<I", 77) + bytes(8))
    case("gguf-block-count-1e9.gguf", "block_count 10**9 in a small file", small_model(block_count=10**9))
    case("gguf-huge-dims.gguf", "embedding_length 2**31 - 1", small_model(embedding_length=2**31 - 1))
    case("gguf-no-tokenizer.gguf", "a small model with no tokenizer", small_model(tokenizer=False))
    case("gguf-no-byte-tokens.gguf", "a vocabulary without byte tokens", small_model(byte_tokens=False))
    case("gguf-freq-base-string.gguf", "llama.rope.freq_base is a string", small_model(freq_base="fast"))
    case("gguf-vocab-size-string.gguf", "llama.vocab_size is a string", small_model(vocab_size="many"))
    scaling = {
        "gguf-rope-yarn.gguf": ("RoPE scaling type yarn (llama.cpp's; not computed here)",
                                {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
        "gguf-rope-unknown-type.gguf": ("RoPE scaling type 'dynamic'", {"llama.rope.scaling.type": "dynamic"}),
        "gguf-rope-factor-negative.gguf": ("rope.scaling.factor -8", {"llama.rope.scaling.factor": -8.0}),
        "gguf-rope-factor-nan.gguf": ("rope.scaling.factor NaN", {"llama.rope.scaling.factor": float("nan")}),
        "gguf-rope-scale-linear-inf.gguf": ("the old rope.scale_linear infinite",
                                            {"llama.rope.scale_linear": float("inf")}),
        "gguf-rope-factor-string.gguf": ("rope.scaling.factor a string", {"llama.rope.scaling.factor": "8"}),
        "gguf-rope-attn-factor.gguf": ("rope.scaling.attn_factor 2", {"llama.rope.scaling.attn_factor": 2.0}),
    }
    for name, (what, overrides) in scaling.items():
        case(name, what, small_model(overrides=overrides))
    case("gguf-spm-no-unk-no-bytes.gguf", "a SentencePiece vocabulary with neither <unk> nor byte tokens",
         small_model(sentencepiece=(range(0), False)))
    case("gguf-spm-no-unk-ascii-bytes.gguf", "a SentencePiece vocabulary with no <unk> and only ASCII byte tokens",
         small_model(sentencepiece=(range(0x80), False)))
    from test_hostile_layout import CASES  # issue #44's table: layout, metadata, numbers

    for name, (what, change, _) in CASES.items():
        case(name, what, crafted(change))
    from test_hostile_templates import TEMPLATES  # the table the test checks each file's refusal against

    for name, (source, bound) in TEMPLATES.items():
        case(f"template-{name}.gguf", f"chat template {source[:48]!r}… (refused: {bound})",
             small_model(overrides={"tokenizer.chat_template": source}))
    return made


def crafted(change: tuple) -> bytes:
    """The small model with one change of test_hostile_layout.CASES."""
    from test_hostile_layout import patched

    if change[0] == "metadata":
        return small_model(overrides=change[1])
    if change[0] == "tensor":
        return small_model(tensors=change[1])
    if change[0] == "embedding-3d":
        return small_model(embedding_3d=True)
    if change[0] == "big-endian":
        import functools
        from unittest import mock

        import gguf

        big = functools.partial(gguf.GGUFWriter, endianess=gguf.GGUFEndian.BIG)
        with mock.patch.object(gguf, "GGUFWriter", big):
            return small_model()
    return patched(small_model(), change)


SPM_PIECES = ["▁", "t", "h", "e", "▁the", "a", "c", "▁cat"]


def small_model(block_count=None, embedding_length=None, tokenizer=True, byte_tokens=True, freq_base=None,
                vocab_size=None, overrides=None, sentencepiece=None, tensors=None, embedding_3d=False) -> bytes:
    """A tiny valid Llama GGUF (random weights), with one thing changed. sentencepiece: (byte values that have
    a <0xNN> token, whether it has <unk>) for a SentencePiece vocabulary instead. tensors: {name: (flat index,
    value)}, one weight of an F32 tensor replaced."""
    import tempfile

    from model_fixtures import write_llama_gguf
    from pagevis.model.synthetic import SyntheticModel

    overrides = dict(overrides or {})
    if block_count is not None:
        overrides["llama.block_count"] = block_count
    if embedding_length is not None:
        overrides["llama.embedding_length"] = embedding_length
    if freq_base is not None:
        overrides["llama.rope.freq_base"] = freq_base
    if vocab_size is not None:
        overrides["llama.vocab_size"] = vocab_size
    spm = {}
    vocab = 256
    if sentencepiece is not None:
        byte_values, unknown = sentencepiece
        pieces = SPM_PIECES + [f"<filler{i}>" for i in range(256 - 3 - unknown - len(byte_values) - len(SPM_PIECES))]
        spm = {"sentencepiece": pieces, "spm_bytes": byte_values, "spm_unknown": unknown}
        vocab = 3 + unknown + len(byte_values) + len(pieces)
    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, seed=2, vocab_size=vocab)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        reshaped = {"token_embd.weight": model.weights.embedding.reshape(vocab, 2, -1)} if embedding_3d else None
        write_llama_gguf(path, model, tokenizer=tokenizer, metadata_overrides=overrides,
                         byte_tokens=byte_tokens, tensor_overrides=reshaped, **spm)
        if tensors:
            path.write_bytes(_with_weights(path, tensors))
        return path.read_bytes()


def _with_weights(path: Path, changes: dict) -> bytes:
    """path's bytes with one F32 weight of each named tensor replaced: {name: (flat index, value)}."""
    from gguf import GGUFReader

    data = bytearray(path.read_bytes())
    offsets = {t.name: int(t.data_offset) for t in GGUFReader(path).tensors}
    for name, (index, value) in changes.items():
        struct.pack_into("<f", data, offsets[name] + 4 * index, value)
    return bytes(data)


def main() -> None:
    """Write the cases into a scratch folder, then copy into tests/data/hostile/ only the files it lacks (with
    --all, every file): the files already there stay as they were written (valid.pvtrace is format version 1, the
    fuzz tests' old-file case), so only new cases are added. MANIFEST is rewritten."""
    import shutil
    import tempfile

    global OUT
    target, rewrite = OUT, "--all" in sys.argv[1:]
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        OUT = Path(folder) / "hostile"
        OUT.mkdir()
        base = base_trace(Path(folder) / "base.pvtrace")
        (OUT / "valid.pvtrace").write_bytes(base.read_bytes())
        made = trace_cases(base)
        kvzip = kvzip_trace(Path(folder) / "kvzip.pvtrace")
        (OUT / "valid-kvzip.pvtrace").write_bytes(kvzip.read_bytes())
        made.update(event_cases(kvzip))
        made.update(gguf_cases())
        added = [p.name for p in sorted(OUT.iterdir()) if rewrite or not (target / p.name).exists()]
        for name in added:
            shutil.copyfile(OUT / name, target / name)
        OUT = target
    lines = [f"{name}\t{what}" for name, what in sorted(made.items())]
    (OUT / "MANIFEST").write_text("\n".join(lines) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{len(made)} hostile files and valid.pvtrace, valid-kvzip.pvtrace in {OUT} ({total / 1e6:.1f} MB); "
          f"written now: {', '.join(added) or 'none'}")


if __name__ == "__main__":
    main()

"""A KV event stream recorded to a file, and read back: the raw ZMQ frames, so playing a recording goes through
the same decoding and sequencing as a live stream (and a window can scrub it).

Format (version 1), little-endian, never pickle:
    b"PAGEVIS-KVEV" | u16 version | u32 header length | header: UTF-8 JSON object
        {"format": "pagevis-kv-events", "version": 1, "endpoints": [names], "meta": {...}}
    then records until the end of the file, each:
        u8 kind (1 live message, 2 replay reply) | u16 endpoint index | f64 receive time (s) | u8 frame count
        | per frame: u32 length, bytes
Every field is checked on reading (kind, index, count ≤ 8, lengths ≤ MAX_PAYLOAD_BYTES, time finite); a file that
breaks a rule raises RecordingError naming the offset. A truncated last record (a recorder killed mid-write) is
reported in `Recording.truncated` and the records before it are kept.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from pagevis.attach.events import MAX_PAYLOAD_BYTES

MAGIC = b"PAGEVIS-KVEV"
FORMAT = "pagevis-kv-events"
VERSION = 1
LIVE, REPLAY = 1, 2
MAX_FRAMES = 8
MAX_HEADER = 1 << 20
MAX_ENDPOINTS = 1024
_RECORD = struct.Struct("<BHdB")
_LENGTH = struct.Struct("<I")
_PREAMBLE = struct.Struct("<HI")


class RecordingError(ValueError):
    pass


@dataclass(frozen=True)
class Record:
    kind: int  # LIVE or REPLAY
    endpoint: int  # index into Recording.endpoints
    time: float  # seconds (monotonic clock of the recorder; 0.0 in the fixtures)
    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class Recording:
    endpoints: tuple[str, ...]
    meta: dict
    records: tuple[Record, ...]
    truncated: bool


class Recorder:
    """Appends records to a file; `close()` (or a with-block) flushes it."""

    def __init__(self, path: str | Path, endpoints: list[str], meta: dict | None = None):
        if not 1 <= len(endpoints) <= MAX_ENDPOINTS:
            raise ValueError(f"a recording holds 1 to {MAX_ENDPOINTS} endpoints")
        header = json.dumps({"format": FORMAT, "version": VERSION, "endpoints": list(endpoints),
                             "meta": meta or {}}, sort_keys=True).encode()
        self._file: BinaryIO = open(path, "wb")
        self._file.write(MAGIC + _PREAMBLE.pack(VERSION, len(header)) + header)
        self._count = len(endpoints)

    def write(self, kind: int, endpoint: int, time: float, frames: list[bytes] | tuple[bytes, ...]) -> None:
        if kind not in (LIVE, REPLAY) or not 0 <= endpoint < self._count or len(frames) > MAX_FRAMES:
            raise ValueError("not a record this format holds")
        parts = [_RECORD.pack(kind, endpoint, time, len(frames))]
        for frame in frames:
            frame = bytes(frame)
            if len(frame) > MAX_PAYLOAD_BYTES:
                raise ValueError("frame too large to record")
            parts += [_LENGTH.pack(len(frame)), frame]
        self._file.write(b"".join(parts))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_recording(path: str | Path, max_bytes: int = 4 << 30) -> Recording:
    """Read and check a whole recording (at most `max_bytes` of file)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise RecordingError(f"{path}: {size} bytes is more than the {max_bytes} allowed")
    data = path.read_bytes()
    endpoints, meta, start = _read_header(data, path)
    records, truncated = [], False
    try:
        for record in _records(data, start, len(endpoints), path):
            records.append(record)
    except _Truncated:
        truncated = True
    return Recording(tuple(endpoints), meta, tuple(records), truncated)


class _Truncated(Exception):
    pass


def _read_header(data: bytes, path: Path) -> tuple[list[str], dict, int]:
    if not data.startswith(MAGIC):
        raise RecordingError(f"{path}: not a pagevis KV event recording (no {MAGIC!r} at the start)")
    at = len(MAGIC)
    if len(data) < at + _PREAMBLE.size:
        raise RecordingError(f"{path}: truncated header")
    version, length = _PREAMBLE.unpack_from(data, at)
    if version != VERSION:
        raise RecordingError(f"{path}: format version {version}; this pagevis reads version {VERSION}")
    at += _PREAMBLE.size
    if length > MAX_HEADER or at + length > len(data):
        raise RecordingError(f"{path}: header length {length} is out of bounds")
    try:
        header = json.loads(data[at:at + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordingError(f"{path}: header is not JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise RecordingError(f"{path}: header does not say {FORMAT} version {VERSION}")
    endpoints, meta = header.get("endpoints"), header.get("meta", {})
    if (not isinstance(endpoints, list) or not 1 <= len(endpoints) <= MAX_ENDPOINTS
            or not all(isinstance(e, str) for e in endpoints) or not isinstance(meta, dict)):
        raise RecordingError(f"{path}: header needs 1 to {MAX_ENDPOINTS} endpoint names and a meta object")
    return endpoints, meta, at + length


def _records(data: bytes, at: int, endpoints: int, path: Path) -> Iterator[Record]:
    end = len(data)
    while at < end:
        start = at
        if at + _RECORD.size > end:
            raise _Truncated
        kind, endpoint, time, count = _RECORD.unpack_from(data, at)
        if kind not in (LIVE, REPLAY) or endpoint >= endpoints or count > MAX_FRAMES or not math.isfinite(time):
            raise RecordingError(f"{path}: bad record at byte {start} (kind {kind}, endpoint {endpoint}, "
                                 f"{count} frames, time {time})")
        at += _RECORD.size
        frames = []
        for _ in range(count):
            if at + _LENGTH.size > end:
                raise _Truncated
            (length,) = _LENGTH.unpack_from(data, at)
            at += _LENGTH.size
            if length > MAX_PAYLOAD_BYTES:
                raise RecordingError(f"{path}: frame of {length} bytes at byte {at}")
            if at + length > end:
                raise _Truncated
            frames.append(data[at:at + length])
            at += length
        yield Record(kind, endpoint, time, tuple(frames))

"""Reading an untrusted zip of JSON and `.npy` members with bounded memory and time.

Nothing here trusts a size the archive declares: the central directory's entry count and size are read
from the end record before `zipfile` parses it, every member is read through a stream that stops at the
size the caller expects, and an `.npy` member's header (shape, dtype) is parsed and compared with what the
caller expects before its array is allocated. Every failure becomes one TraceError naming the file, the
member and what is wrong. Never pickle: `.npy` headers are parsed with NumPy's literal parser and the
data is copied into an array of a dtype the caller chose.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from math import prod

import numpy as np

MAX_MEMBERS = 256
MAX_CENTRAL_DIRECTORY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64
CHUNK_BYTES = 1 << 20
END_RECORD = struct.Struct("<4s4H2LH")  # end of central directory: signature ... comment length
END_SIGNATURE = b"PK\x05\x06"
COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
# What a damaged zip, deflate stream or .npy header raises from zipfile, zlib or NumPy.
CORRUPT = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, TypeError, struct.error,
           NotImplementedError, RuntimeError, OverflowError, SyntaxError)


class TraceError(ValueError):
    """A trace file that cannot be read: missing, not a trace, truncated, corrupt, too large, or too new."""


class Archive:
    """A zip archive opened for bounded reads; use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise TraceError(f"{path}: no such trace file")
        if not os.path.isfile(path):
            raise TraceError(f"{path}: not a trace file (a folder or a device)")
        self.size = os.path.getsize(path)
        self._check_end_record()
        try:
            self._zip = zipfile.ZipFile(path)
            infos = self._zip.infolist()
        except UnicodeDecodeError:
            raise TraceError(f"{path}: a member name is not valid UTF-8; not a pagevis trace") from None
        except CORRUPT as error:
            raise TraceError(f"{path}: not a pagevis trace, or truncated or corrupt ({_reason(error)})") from None
        names = [info.filename for info in infos]
        if len(set(names)) != len(names):
            self.close()
            raise TraceError(f"{path}: the archive holds two members of the same name; not a pagevis trace")
        self._infos = {info.filename: info for info in infos}

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_zip", None) is not None:
            self._zip.close()

    def names(self) -> set[str]:
        return set(self._infos)

    def read_json(self, name: str, max_bytes: int):
        """The member parsed as UTF-8 JSON (no NaN or Infinity), at most `max_bytes` and MAX_JSON_DEPTH deep."""
        raw = self._read_bytes(name, max_bytes)
        try:
            value = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        except RecursionError:
            raise TraceError(f"{self.path}: {name} is nested too deeply") from None
        except (UnicodeDecodeError, ValueError) as error:
            raise TraceError(f"{self.path}: {name} is not valid JSON ({_reason(error)})") from None
        if json_depth(value) > MAX_JSON_DEPTH:
            raise TraceError(f"{self.path}: {name} is nested more than {MAX_JSON_DEPTH} levels deep")
        return value

    def read_npy(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The member as an array that must have exactly this dtype and shape (checked before allocating)."""
        dtype = np.dtype(dtype)
        nbytes = prod(shape) * dtype.itemsize
        info = self._info(name, limit=nbytes + 65_536 + 16)
        where = f"{self.path}: array {name}"
        try:
            with self._zip.open(info) as stream:
                found_shape, fortran, found_dtype = _npy_header(stream, where)
                if found_dtype != dtype or tuple(found_shape) != tuple(shape) or fortran:
                    order = ", Fortran order" if fortran else ""
                    raise TraceError(f"{where} is {found_dtype.str} {list(found_shape)}{order}; the header says "
                                     f"{dtype.str} {list(shape)}")
                if info.file_size != stream.tell() + nbytes:
                    raise TraceError(f"{where} declares {info.file_size} bytes; its .npy header implies "
                                     f"{stream.tell() + nbytes}")
                array = np.empty(shape, dtype=dtype)
                _read_exactly(stream, memoryview(array.reshape(-1).view(np.uint8)), where)
                if stream.read(1):
                    raise TraceError(f"{where} has data after its {nbytes} bytes")
        except TraceError:
            raise
        except CORRUPT as error:
            raise TraceError(f"{where} is corrupt ({_reason(error)})") from None
        return array

    # --- internals ---------------------------------------------------------------------------------
    def _check_end_record(self) -> None:
        """Refuse an archive whose central directory is too large before zipfile reads it all into memory."""
        try:
            with open(self.path, "rb") as file:
                tail_size = min(self.size, END_RECORD.size + 65_535)
                file.seek(self.size - tail_size)
                tail = file.read(tail_size)
        except OSError as error:
            raise TraceError(f"{self.path}: cannot read ({error.strerror})") from None
        at = tail.rfind(END_SIGNATURE)
        if at < 0 or len(tail) - at < END_RECORD.size:
            raise TraceError(f"{self.path}: not a pagevis trace, or truncated or corrupt (no zip end record)")
        _, _, _, _, entries, directory_bytes, _, _ = END_RECORD.unpack_from(tail, at)
        if entries == 0xFFFF or directory_bytes == 0xFFFFFFFF:
            raise TraceError(f"{self.path}: a ZIP64 archive; pagevis traces are smaller than 2 GiB and never ZIP64")
        if entries > MAX_MEMBERS or directory_bytes > MAX_CENTRAL_DIRECTORY_BYTES:
            raise TraceError(f"{self.path}: the archive lists {entries} members in {directory_bytes} bytes; a "
                             f"pagevis trace has at most {MAX_MEMBERS}")

    def _info(self, name: str, limit: int) -> zipfile.ZipInfo:
        info = self._infos.get(name)
        if info is None:
            raise TraceError(f"{self.path}: the trace is incomplete ({name} is missing)")
        if info.flag_bits & 0x1:
            raise TraceError(f"{self.path}: {name} is encrypted; pagevis traces are never encrypted")
        if info.compress_type not in COMPRESSIONS:
            raise TraceError(f"{self.path}: {name} uses compression method {info.compress_type}; pagevis "
                             f"traces use {' or '.join(COMPRESSIONS.values())}")
        if info.file_size > limit:
            raise TraceError(f"{self.path}: {name} declares {info.file_size} bytes uncompressed; at most {limit} "
                             "are allowed there")
        return info

    def _read_bytes(self, name: str, max_bytes: int) -> bytes:
        info = self._info(name, limit=max_bytes)
        try:
            with self._zip.open(info) as stream:
                data = stream.read(max_bytes + 1)
        except CORRUPT as error:
            raise TraceError(f"{self.path}: {name} is corrupt ({_reason(error)})") from None
        if len(data) > max_bytes:
            raise TraceError(f"{self.path}: {name} is larger than {max_bytes} bytes")
        return data


def _npy_header(stream, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from an .npy header (at most 64 KiB, parsed as a Python literal)."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(stream, max_header_size=65_536)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(stream, max_header_size=65_536)
    except CORRUPT as error:
        raise TraceError(f"{where} is corrupt ({_reason(error)})") from None
    except Exception as error:  # noqa: BLE001 - NumPy's literal parser raises tokenize, recursion, memory errors
        raise TraceError(f"{where} has an .npy header that cannot be parsed ({type(error).__name__})") from None
    raise TraceError(f"{where} is .npy format version {version}; pagevis reads 1.0 and 2.0")


def _read_exactly(stream, target: memoryview, where: str) -> None:
    filled = 0
    while filled < len(target):
        chunk = stream.read(min(CHUNK_BYTES, len(target) - filled))
        if not chunk:
            raise TraceError(f"{where} is truncated ({filled} of {len(target)} bytes)")
        target[filled: filled + len(chunk)] = chunk
        filled += len(chunk)


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value, iteratively (a deep value must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _reason(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 200 else text[:200] + "…"

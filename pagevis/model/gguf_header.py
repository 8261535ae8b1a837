"""A bounded walk over a GGUF file's header, metadata and tensor table, before the gguf reader parses it.

The gguf package trusts every count and length in the file: a 49-byte file whose metadata array claims
2**40 elements makes it allocate without end. This walk reads the same structure with `struct` on a
memory map and checks each count and length against the bytes the file has, against fixed caps (the
tensor count, string arrays, nesting) and against the value types GGUF defines, so that the reader only
ever sees a file whose structure fits in it. It keeps nothing but a few numbers.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path

from pagevis.model.errors import ModelLoadError

MAX_TENSORS = 1 << 16
MAX_METADATA = 1 << 16
MAX_STRING_ARRAY = 1 << 21  # vocabularies and merge lists (Llama 3: 128k tokens, 280k merges)
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_NESTING = 2
MAX_DIMS = 4  # GGML_MAX_DIMS
SUPPORTED_VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# GGUF value type -> bytes per item, for the fixed-size types.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@functools.lru_cache(maxsize=32)
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


class _Walk:
    def __init__(self, path: Path, data, order: str):
        self.path, self.data, self.order, self.at = path, data, order, 0
        self.size = len(data)

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} ({self.size} bytes) is truncated or corrupt: {what}")

    def unpack(self, fmt: str, what: str):
        layout = _struct(self.order + fmt)
        if self.at + layout.size > self.size:
            raise self.fail(f"{what} at byte {self.at} runs past the end of the file")
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values if len(values) > 1 else values[0]

    def skip(self, count: int, item_bytes: int, what: str) -> None:
        if count > (self.size - self.at) // max(item_bytes, 1):
            raise self.fail(f"{what} claims {count} items of {item_bytes} bytes at byte {self.at}, more than the "
                            f"{self.size - self.at} bytes left")
        self.at += count * item_bytes

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.unpack("Q", what)
        if limit is not None and length > limit:
            raise self.fail(f"{what} is {length} bytes long, more than {limit}")
        start = self.at
        if length > self.size - self.at:
            raise self.fail(f"{what} claims a string of {length} bytes at byte {self.at}, more than the "
                            f"{self.size - self.at} bytes left")
        self.skip(length, 1, what)
        return bytes(self.data[start: self.at]) if limit is not None else b""

    def strings(self, count: int, what: str) -> None:
        """Skip `count` strings (a vocabulary: the one loop here that runs 10**5 times, so kept lean)."""
        length_of = struct.Struct(self.order + "Q").unpack_from
        data, at, size = self.data, self.at, self.size
        for _ in range(count):
            if at + 8 > size:
                break
            at += 8 + length_of(data, at)[0]
        else:
            if at <= size:
                self.at = at
                return
        self.at = min(at, size)
        raise self.fail(f"{what} runs past the end of the file")

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in FIXED_SIZES:
            self.skip(1, FIXED_SIZES[kind], what)
        elif kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_NESTING} deep")
            item, count = self.unpack("IQ", what)
            if item in FIXED_SIZES:
                self.skip(count, FIXED_SIZES[item], what)
                return
            if count > MAX_STRING_ARRAY:
                raise self.fail(f"{what} is an array of {count} strings or arrays, more than {MAX_STRING_ARRAY}")
            self.skip(count, 8, what)  # each item takes at least its 8-byte length: a cheap early refusal
            self.at -= count * 8
            if item == STRING:
                self.strings(count, what)
            else:
                for _ in range(count):
                    self.value(item, what, depth + 1)
        else:
            raise self.fail(f"{what} has value type {kind}, which GGUF does not define")


def check_gguf_structure(path: Path) -> int:
    """Walk the header, metadata and tensor table of a GGUF file; ModelLoadError if anything does not fit.
    Returns where the tensor table ends."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        version = struct.unpack_from("<I", data, 4)[0]
        order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge little-endian version
        walk = _Walk(path, data, order)
        walk.at = 4
        version, n_tensors, n_metadata = walk.unpack("IQQ", "the header")
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions "
                                 f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        if n_tensors > MAX_TENSORS:
            raise walk.fail(f"the header claims {n_tensors} tensors, more than {MAX_TENSORS}")
        if n_metadata > MAX_METADATA:
            raise walk.fail(f"the header claims {n_metadata} metadata entries, more than {MAX_METADATA}")
        for index in range(n_metadata):
            key = walk.string(f"metadata key {index}", MAX_KEY_BYTES).decode("utf-8", errors="replace")
            kind = walk.unpack("I", f"metadata {key!r}")
            walk.value(kind, f"metadata {key!r}")
        for index in range(n_tensors):
            name = walk.string(f"tensor name {index}", MAX_KEY_BYTES).decode("utf-8", errors="replace")
            n_dims = walk.unpack("I", f"tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise walk.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
            dims = walk.unpack("Q" * n_dims, f"tensor {name!r}")
            dims = dims if isinstance(dims, tuple) else (dims,)
            elements = 1
            for dim in dims:
                elements *= dim
            if elements > walk.size * 8:  # no tensor type packs more than 8 elements per byte
                raise walk.fail(f"tensor {name!r} has shape {list(dims)}, more elements than the file can hold")
            walk.unpack("IQ", f"tensor {name!r}")  # type, offset: checked by the reader and the loader
        return walk.at

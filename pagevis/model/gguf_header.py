"""A bounded walk over a GGUF file's header, metadata and tensor table, before the gguf reader parses it.

The gguf package trusts every count and length in the file: a 49-byte file whose metadata array claims
2**40 elements makes it allocate without end. This walk reads the same structure with `struct` on a
memory map and checks each count and length against the bytes the file has, against fixed caps (the
tensor count, string arrays, nesting) and against the value types GGUF defines, so that the reader only
ever sees a file whose structure fits in it. It keeps nothing but a few numbers and the tensor table.

Then the data section is checked as llama.cpp's gguf.cpp checks it (gguf_init_from_reader), before anything reads
a tensor: the byte order is the machine's (little-endian: a big-endian file is refused, as llama.cpp refuses a
file of the other byte order), general.alignment is a uint32 power of two, keys and tensor names are unique and
names shorter than 64 bytes, each tensor's type is a ggml type whose block divides its rows, its byte count is
type x dims, and its offset is aligned, inside the data section (which starts at the tensor table's end rounded up
to the alignment) and is where llama.cpp expects it: the tensors laid end to end in table order, each padded to
the alignment -- so no two overlap, none starts inside the header or wraps around 2**64 (the gguf reader adds
offsets in uint64) and the last ends inside the file. Each refusal is one line naming the tensor and the rule.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagevis.model.errors import ModelLoadError

MAX_TENSORS = 1 << 16
MAX_METADATA = 1 << 16
MAX_STRING_ARRAY = 1 << 21  # vocabularies and merge lists (Llama 3: 128k tokens, 280k merges)
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_NESTING = 2
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is shorter
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
ALIGNMENT_KEY, UINT32 = b"general.alignment", 4
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


@functools.lru_cache(maxsize=8)
def _table_digest(path: str, *stat: int) -> str:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return hashlib.sha256(data[:check_gguf_structure(Path(path))]).hexdigest()[:32]


def table_digest(path: Path) -> str:
    """The SHA-256 of a GGUF file's header, metadata and tensor table (a few MB: its vocabulary; ~10 ms): with its
    size and modification time, the cheap key of what a cache derived from the file was derived from (never a
    read of every weight byte). ModelLoadError if the file's structure is refused."""
    stat = path.stat()
    return _table_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


class Tensor:
    """One entry of the tensor table: what the layout checks need."""

    __slots__ = ("name", "dims", "kind", "offset")

    def __init__(self, name: str, dims: tuple[int, ...], kind: int, offset: int):
        self.name, self.dims, self.kind, self.offset = name, dims, kind, offset


def check_gguf_structure(path: Path) -> int:
    """Walk the header, metadata and tensor table of a GGUF file and check its data section's layout as llama.cpp
    does; ModelLoadError saying what does not fit. Returns where the tensor table ends."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if not struct.unpack_from("<I", data, 4)[0] & 0xFFFF:  # version 3 read in the other byte order: 0x03000000
            raise ModelLoadError(f"{path}: a big-endian GGUF file; pagevis reads little-endian GGUF files only (as "
                                 f"llama.cpp refuses a file whose byte order is not the machine's)")
        walk = _Walk(path, data, "<")
        walk.at = 4
        version, n_tensors, n_metadata = walk.unpack("IQQ", "the header")
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions "
                                 f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        if n_tensors > MAX_TENSORS:
            raise walk.fail(f"the header claims {n_tensors} tensors, more than {MAX_TENSORS}")
        if n_metadata > MAX_METADATA:
            raise walk.fail(f"the header claims {n_metadata} metadata entries, more than {MAX_METADATA}")
        alignment = _walk_metadata(walk, n_metadata)
        tensors = [_walk_tensor(walk, index) for index in range(n_tensors)]
        check_layout(path, walk.size, walk.at, alignment, tensors)
        return walk.at


def _walk_metadata(walk: _Walk, count: int) -> int:
    """Walk count metadata entries; the file's alignment (general.alignment, checked as llama.cpp does)."""
    keys, alignment = set(), DEFAULT_ALIGNMENT
    for index in range(count):
        raw = walk.string(f"metadata key {index}", MAX_KEY_BYTES)
        key = raw.decode("utf-8", errors="replace")
        if not raw or raw in keys:
            raise ModelLoadError(f"{walk.path}: metadata key {index} {key!r} is {'empty' if not raw else 'repeated'} "
                                 f"(llama.cpp refuses empty and duplicate keys)")
        keys.add(raw)
        kind = walk.unpack("I", f"metadata {key!r}")
        if raw == ALIGNMENT_KEY:
            if kind != UINT32:
                raise ModelLoadError(f"{walk.path}: metadata key general.alignment has value type {kind}; GGUF "
                                     f"requires a uint32")
            alignment = walk.unpack("I", "general.alignment")
            if not alignment or alignment & (alignment - 1):
                raise ModelLoadError(f"{walk.path}: general.alignment is {alignment}, not a power of two")
            continue
        walk.value(kind, f"metadata {key!r}")
    return alignment


def _walk_tensor(walk: _Walk, index: int) -> Tensor:
    raw = walk.string(f"tensor name {index}", MAX_KEY_BYTES)
    name = raw.decode("utf-8", errors="replace")
    if len(raw) >= MAX_NAME:
        raise ModelLoadError(f"{walk.path}: tensor {index}'s name is {len(raw)} bytes long; ggml's names are shorter "
                             f"than {MAX_NAME}")
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
    kind, offset = walk.unpack("IQ", f"tensor {name!r}")
    return Tensor(name, dims, kind, offset)


def tensor_bytes(tensor: Tensor) -> int:
    """Bytes of the tensor's data: type x dims, as ggml_nbytes (its type known, its rows whole blocks)."""
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.kind)]
    elements = 1
    for dim in tensor.dims:
        elements *= dim
    return elements // block * block_bytes


def check_layout(path: Path, size: int, table_end: int, alignment: int, tensors: list[Tensor]) -> None:
    """The tensors' types, byte counts and offsets as llama.cpp checks them (see the module's docstring)."""
    start = -(-table_end // alignment) * alignment if tensors else table_end  # the data section
    names: set[str] = set()
    expected, previous, previous_bytes = 0, None, 0
    for tensor in tensors:
        where = f"{path}: tensor {tensor.name}"
        if tensor.name in names:
            raise ModelLoadError(f"{where} is named twice in the tensor table (llama.cpp refuses duplicate names)")
        names.add(tensor.name)
        try:
            block = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.kind)][0]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{where} has type {tensor.kind}, which is not a ggml type") from None
        if tensor.dims[0] % block:
            raise ModelLoadError(f"{where} has rows of {tensor.dims[0]} elements, not whole blocks of {block} "
                                 f"({GGMLQuantizationType(tensor.kind).name})")
        nbytes = tensor_bytes(tensor)
        absolute = start + tensor.offset
        if tensor.offset % alignment:
            raise ModelLoadError(f"{where}: offset {tensor.offset} is not a multiple of the alignment {alignment}")
        if absolute >= 1 << 64:
            raise ModelLoadError(f"{where}: offset {tensor.offset} plus the data section's start {start} wraps "
                                 f"around 2**64")
        if absolute + nbytes > size:
            raise ModelLoadError(f"{where}: its {nbytes} bytes (type x dims) at byte {absolute} run past the end of "
                                 f"the file ({size} bytes): the file is truncated or the offset is wrong")
        if tensor.offset < expected and previous is not None:
            raise ModelLoadError(f"{where}: its bytes at data offset {tensor.offset} overlap tensor {previous}'s "
                                 f"(which end at {expected})")
        if tensor.offset != expected:
            after = f"after tensor {previous}'s {previous_bytes} bytes (type x dims)" if previous else "first"
            raise ModelLoadError(f"{where}: offset {tensor.offset}, where llama.cpp expects {expected}: {after}, "
                                 f"padded to the alignment {alignment} (tensors lie end to end in table order)")
        expected += -(-nbytes // alignment) * alignment
        previous, previous_bytes = tensor.name, nbytes

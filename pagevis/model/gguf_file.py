"""Reading a GGUF file with the `gguf` package, turning its failures into ModelLoadError."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pagevis.model.errors import ModelLoadError
from pagevis.model.gguf_header import check_gguf_structure

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
SUPPORTED_TENSOR_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
))


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map, with a lean walk over long arrays.

    GGUFReader slices its np.memmap a few hundred thousand times while parsing (every vocabulary
    string is its own slice), and each memmap slice pays memmap.__array_finalize__: parsing
    SmolLM2 takes ~6 s. Slicing a plain ndarray view of the same mapping takes ~1.5 s. It also reads an
    array item by item (three numpy calls per string, one per number: over a million for Gemma's 262 144
    tokens, scores and types); _get_field_parts below reads a number array in one view and a string array
    with struct, giving the same parts (so field.contents() is unchanged).
    """

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, item]
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is not None:  # one view; contents() flattens parts[data] either way
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
        if item != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: rare and short
        plain, length_of = self._plain, struct.Struct("<Q").unpack_from
        parts, data = [raw_itype, alen], []
        for _ in range(count):
            length = length_of(plain, offs)[0]
            data.append(len(parts) + 1)
            parts += [plain[offs:offs + 8].view(np.uint64), plain[offs + 8:offs + 8 + length]]
            offs += 8 + length
        return offs - orig_offs, parts, data, types

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._mapped = mapped
        self._plain = mapped.view(np.ndarray)


def check_gguf_start(path: Path) -> int:
    """The file's size, if path is a file that starts as a GGUF file does; ModelLoadError saying why not. Cheap:
    the command line asks it before the app opens a window on the file."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    size = path.stat().st_size
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    if size < HEADER_BYTES:
        raise ModelLoadError(f"{path} is truncated: {size} bytes is shorter than a GGUF header")
    return size


def open_gguf(path: Path) -> GGUFReader:
    """Parse path's header, metadata and tensor table, or raise ModelLoadError saying why not."""
    size = check_gguf_start(path)
    check_gguf_structure(path)  # every count and length fits the file before the gguf reader trusts them
    try:
        reader = _PlainArrayReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(
            f"{path} ({size} bytes) is truncated or corrupt: its GGUF header, metadata or tensor "
            f"table could not be parsed ({type(exc).__name__}: {exc})"
        ) from exc
    _check_tensor_extents(path, reader, size)
    return reader


def _check_tensor_extents(path: Path, reader: GGUFReader, size: int) -> None:
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(
                f"{path} is truncated: tensor {tensor.name} needs bytes up to {end}, "
                f"but the file has {size}"
            )


def release_pages(reader: GGUFReader, tensor: Any) -> None:
    """Drop this tensor's pages of the file mapping from the process (they stay in the page cache): once a tensor is
    repacked its mapped bytes would otherwise count in the resident set until the reader is gone."""
    mapped = getattr(getattr(reader, "_mapped", None), "_mmap", None)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-int(tensor.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def read_metadata(reader: GGUFReader, skip_arrays_longer_than: int | None = None) -> dict[str, Any]:
    """Metadata as Python values (strings, numbers, lists)."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        is_array = field.types and field.types[0] == GGUFValueType.ARRAY
        if is_array and skip_arrays_longer_than is not None and len(field.data) > skip_arrays_longer_than:
            continue
        metadata[key] = field_contents(reader, key)
    return metadata


def field_contents(reader: GGUFReader, key: str) -> Any:
    """A metadata field as Python values; ModelLoadError naming the key if its bytes do not decode."""
    try:
        return reader.fields[key].contents()
    except (UnicodeDecodeError, ValueError, IndexError, TypeError, OverflowError) as exc:
        raise ModelLoadError(f"{getattr(reader, 'path', 'the model file')}: metadata key {key} cannot be read "
                             f"({type(exc).__name__}: {exc})") from None


def tensor_as_float32(path: Path, tensor: Any, expected_shape: tuple[int, ...]) -> np.ndarray:
    """Dequantise one tensor to float32 in numpy order (GGUF dims reversed), checking type and shape."""
    shape = check_tensor(path, tensor, expected_shape)
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: cannot dequantise tensor {tensor.name}: {exc}") from exc
    return np.asarray(values, dtype=np.float32).reshape(shape)


def check_tensor(path: Path, tensor: Any, expected_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tensor's shape in numpy order if its type is supported and its shape expected; else ModelLoadError."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which pagevis does not "
            f"support (supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if shape != expected_shape:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has shape {shape}, but the metadata implies {expected_shape}"
        )
    return shape

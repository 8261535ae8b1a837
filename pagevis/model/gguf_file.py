"""Reading a GGUF file with the `gguf` package, turning its failures into ModelLoadError."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize

from pagevis.model.errors import ModelLoadError
from pagevis.model.gguf_header import check_gguf_structure
from pagevis.model.resident import release_whole_pages

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
SUPPORTED_TENSOR_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
))


class _LeanArray(ReaderField):
    """A metadata array of numbers or strings read lean: its last part is one view of all its items (the values, or
    the strings with their 8-byte lengths, as the file lays them out), and `data` is range(item count) -- indices of
    items, not of parts. contents() decodes the items in one pass: no numpy object per item (Gemma's 262 144 tokens
    made 524 288 views, ~100 MiB)."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        items = self.parts[-1]
        values = _strings(items, len(self.data)) if self.types[-1] == GGUFValueType.STRING else items.tolist()
        return values[index_or_slice]


def _strings(items: np.ndarray, count: int) -> list[str]:
    """count length-prefixed UTF-8 strings (native byte order) laid out one after the other in items."""
    view, length_of, at, out = items.data, struct.Struct("=Q").unpack_from, 0, []
    for _ in range(count):
        length = length_of(view, at)[0]
        out.append(str(view[at + 8:at + 8 + length], "utf-8"))
        at += 8 + length
    return out


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map, with a lean walk over long arrays.

    GGUFReader slices its np.memmap a few hundred thousand times while parsing (every vocabulary
    string is its own slice), and each memmap slice pays memmap.__array_finalize__: parsing
    SmolLM2 takes ~6 s. Slicing a plain ndarray view of the same mapping takes ~1.5 s. It also reads an
    array item by item (three numpy calls per string, one per number: over a million for Gemma's 262 144
    tokens, scores and types), keeping two numpy views per string. Here an array of numbers or strings becomes a
    _LeanArray (one view of its items, decoded by contents()); other fields are read as GGUFReader reads them.
    """

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        for _ in range(count):  # GGUFReader._build_fields, with long arrays read lean
            orig_offs = offs
            key_length, key = self._get_str(offs)
            offs += int(key_length.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head: list[np.ndarray] = [key_length, key, raw_type]
            lean = self._lean_array(offs) if raw_type[0] == GGUFValueType.ARRAY else None
            if lean is None:
                size, parts, indices, types = self._get_field_parts(offs, raw_type[0])
                field = ReaderField(orig_offs, str(bytes(key), encoding="utf-8"), head + parts,
                                    [index + len(head) for index in indices], types)
            else:
                size, parts, item_count, types = lean
                # data: the items' indices as a range (GGUFReader's field holds a list of them)
                field = _LeanArray(orig_offs, str(bytes(key), encoding="utf-8"), head + parts,
                                   range(item_count), types)  # type: ignore[arg-type]
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _lean_array(self, offs: int) -> tuple[int, list[np.ndarray], int, list[GGUFValueType]] | None:
        """(bytes, parts, item count, types) of the array at offs if its items are numbers or strings, else None."""
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        item, count, start = GGUFValueType(int(raw_itype[0])), int(alen[0]), offs + 12
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is not None:
            items = self._get(start, nptype, count)
        elif item == GGUFValueType.STRING:  # the walk only: check_gguf_structure has bounded every length
            view, length_of, end = self._plain.data, struct.Struct("=Q").unpack_from, start
            for _ in range(count):
                end += 8 + length_of(view, end)[0]
            items = self._plain[start:end]
        else:
            return None  # nested arrays: rare and short
        return 12 + int(items.nbytes), [raw_itype, alen, items], count, [GGUFValueType.ARRAY, item]

    # the memmap read as a plain ndarray (see the class), where GGUFReader declares a memmap
    @property  # type: ignore[override]
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


def check_gguf_file(path: Path) -> int:
    """check_gguf_start, then the structural checks (gguf_header.py: every count and length fits the file, the
    tensors' layout is llama.cpp's); the file's size. Reads the header and tables only: the command line asks it
    before `pagevis serve`, `run` or the app take the file."""
    size = check_gguf_start(path)
    check_gguf_structure(path)
    return size


def open_gguf(path: Path) -> GGUFReader:
    """Parse path's header, metadata and tensor table, or raise ModelLoadError saying why not."""
    size = check_gguf_file(path)  # every count, length and offset fits the file before the gguf reader trusts them
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
    _drop_pages(reader, int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes))


def release_metadata_pages(reader: GGUFReader) -> None:
    """Drop the pages of the header, metadata and tensor table from the process, as release_pages does: once the
    tokenizer is built nothing reads the vocabulary's bytes again (Gemma's: 6 MiB). A later read maps them back."""
    _drop_pages(reader, 0, int(reader.data_offset))


def _drop_pages(reader: GGUFReader, start: int, end: int) -> None:
    mapped = getattr(getattr(reader, "_mapped", None), "_mmap", None)  # the reader's read-only np.memmap's mmap
    if mapped is not None:
        release_whole_pages(mapped, start, end)


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


def field_values(reader: GGUFReader, key: str) -> Any:
    """field_contents, but an array of numbers read lean comes back as one ndarray (a copy: it does not hold the
    file's mapping) instead of a list of Python numbers."""
    field = reader.fields[key]
    if isinstance(field, _LeanArray) and field.types[-1] != GGUFValueType.STRING:
        return np.array(field.parts[-1])
    return field_contents(reader, key)


def tensor_as_float32(path: Path, tensor: Any, expected_shape: tuple[int, ...]) -> np.ndarray:
    """Dequantise one tensor to float32 in numpy order (GGUF dims reversed), checking type and shape."""
    shape = check_tensor(path, tensor, expected_shape)
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: cannot dequantise tensor {tensor.name}: {exc}") from exc
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    check_finite(path, tensor.name, values)
    return values


def check_finite(path: Path, name: str, values: np.ndarray) -> None:
    """ModelLoadError naming the tensor if values hold an infinity or a NaN (an F32/F16/BF16 weight, or a block
    scale a dequantised value inherits). Two vectorised passes, no temporary: min and max propagate NaN, and an
    infinity is one of them (SmolLM2's 135M float32 weights: ~0.1 s)."""
    if values.size and not (np.isfinite(values.min()) and np.isfinite(values.max())):
        bad = int(np.argmax(~np.isfinite(values.reshape(-1))))  # the refusal only: which one, for the message
        raise ModelLoadError(f"{path}: tensor {name} holds {values.reshape(-1)[bad]} at flat index {bad}: the "
                             f"file's weights must be finite numbers")


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

"""The dequantised float32 weights of a GGUF file kept on disk, so that a second launch maps them instead of
dequantising again (Gemma 3 270M: the 262144 x 640 embedding alone takes ~10 s to dequantise, see docs/model.md).

One directory per source file under <cache>/weights/, named by the file's resolved path, size and modification
time, the SHA-256 of its header, metadata and tensor table (gguf_header.table_digest: the cheap key, no weight byte
read) and the gguf package's version: a changed file gets a new entry. Each array is an .npy file (read with
allow_pickle=False, memory-mapped read-only); a manifest lists every array's shape, dtype and CRC-32 (taken when
the entry is written, checked when it is read: two threads, 16 MiB at a time, each part's pages dropped after;
SmolLM2's 540 MB: +0.6 s of load on a busy 2-core machine, +7 MiB peak RSS) and the source's identity, and is
checked before use, and the model then checks every shape against its config. An entry that fails a check is
rebuilt, said once on stderr. Files below MIN_CACHED_BYTES of float32 weights are not cached (dequantising them is fast); at most MAX_ENTRIES entries are
kept, the least recently written removed first. PAGEVIS_WEIGHT_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

from pagevis.model.gguf_header import table_digest
from pagevis.model.matmul import cache_dir
from pagevis.model.quantized import file_pages_dropper
from pagevis.model.weights import LayerWeights, DecoderWeights

CACHE_VERSION = 2  # bump when what is stored changes (DecoderWeights' fields, their layout)
MIN_CACHED_BYTES = 64 << 20
MAX_ENTRIES = 4
CRC_CHUNK = 16 << 20  # bytes of a cached array checked before its pages are dropped
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # stored output-major (the C-contiguous array behind the view)
OPTIONAL_VECTORS = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")  # the layouts' own
VECTORS = ("attn_norm", "ffn_norm", *OPTIONAL_VECTORS)


def enabled(weight_bytes: int) -> bool:
    return os.environ.get("PAGEVIS_WEIGHT_CACHE", "1") != "0" and weight_bytes >= MIN_CACHED_BYTES


def entry_for(source: Path, root: Path | None = None) -> tuple[Path, dict]:
    stat = source.stat()
    identity = {"version": CACHE_VERSION, "gguf": _gguf_version(), "source": str(source.resolve()),
                "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "table": table_digest(source)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return (root or cache_dir() / "weights") / key, identity


@lru_cache(maxsize=1)
def _gguf_version() -> str:
    """The dequantiser's version: a release that fixes a quantisation type must not meet old cached weights."""
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load(source: Path, root: Path | None = None) -> DecoderWeights | None:
    """The cached weights of source, or None when there is no valid entry (then the caller dequantises)."""
    folder, identity = entry_for(source, root)
    if not (folder / "manifest.json").exists():
        return None
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("identity") != identity:
            raise ValueError("its manifest names another source")
        arrays = {name: _mapped(folder, name, shape, dtype) for name, (shape, dtype, _) in manifest["arrays"].items()}
        _check_content(arrays, {name: crc for name, (_, _, crc) in manifest["arrays"].items()})
        return _weights(arrays, manifest["n_layers"], manifest["tied"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"pagevis: the float32 weight cache {folder} failed its check ({exc}); rebuilding it",
              file=sys.stderr, flush=True)
        return None


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(array.data.cast("B"))  # lets go of the GIL: two arrays at once on two threads


def _mapped_crc(array: np.ndarray) -> int:
    """_crc of a read-only mapped array, 16 MiB at a time, each part's pages then dropped from the process (they stay
    in the page cache): the check leaves nothing resident before the model runs (SmolLM2 after load: 581 MiB
    checking whole arrays, 89 MiB so, 82 MiB without the check). Through the mapping: reading the files into a
    buffer took twice as long."""
    flat, crc = array.reshape(-1).view(np.uint8), 0
    for start in range(0, len(flat), CRC_CHUNK):
        part = flat[start:start + CRC_CHUNK]
        crc = zlib.crc32(part.data, crc)
        drop = file_pages_dropper([part])
        if drop is not None:
            drop()
    return crc


def _check_content(arrays: dict[str, np.ndarray], expected: dict[str, int]) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, crc in zip(arrays, pool.map(_mapped_crc, arrays.values())):
            if crc != expected[name]:
                raise ValueError(f"{name}.npy's CRC-32 is {crc:08x}, its manifest's {expected[name]:08x}")


def store(source: Path, weights: DecoderWeights, root: Path | None = None) -> None:
    """Write weights as source's entry (atomically: a temporary directory renamed); a full disk only costs the
    cache."""
    folder, identity = entry_for(source, root)
    temporary = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    try:
        temporary.mkdir(parents=True, exist_ok=True)
        arrays = _arrays(weights)
        for name, array in arrays.items():
            np.save(temporary / f"{name}.npy", array, allow_pickle=False)
        manifest = {"identity": identity, "n_layers": len(weights.layers),
                    "tied": np.shares_memory(_dense_embedding(weights), weights.output_t),
                    "arrays": {name: [list(a.shape), a.dtype.str, _crc(a)] for name, a in arrays.items()}}
        (temporary / "manifest.json").write_text(json.dumps(manifest))
        shutil.rmtree(folder, ignore_errors=True)
        temporary.rename(folder)
        _trim(folder.parent)
    except OSError:
        shutil.rmtree(temporary, ignore_errors=True)


def _dense_embedding(weights: DecoderWeights) -> np.ndarray:
    if not isinstance(weights.embedding, np.ndarray):
        raise TypeError("the weight cache holds float32 weights only, not packed ones")
    return weights.embedding


def _arrays(weights: DecoderWeights) -> dict[str, np.ndarray]:
    arrays = {"embedding": _dense_embedding(weights), "output_norm": weights.output_norm}
    if not np.shares_memory(arrays["embedding"], weights.output_t):
        arrays["output"] = weights.output_t.T
    for index, layer in enumerate(weights.layers):
        arrays.update({f"{index}.{name}": getattr(layer, name).T for name in MATRICES})
        arrays.update({f"{index}.{name}": getattr(layer, name) for name in VECTORS if getattr(layer, name) is not None})
    return {name: np.ascontiguousarray(array) for name, array in arrays.items()}


def _weights(arrays: dict[str, np.ndarray], n_layers: int, tied: bool) -> DecoderWeights:
    layers = tuple(_layer(arrays, index) for index in range(n_layers))
    embedding = arrays["embedding"]
    return DecoderWeights(embedding, layers, arrays["output_norm"], embedding.T if tied else arrays["output"].T)


def _layer(arrays: dict[str, np.ndarray], index: int) -> LayerWeights:
    def matrix(name: str) -> np.ndarray:
        return arrays[f"{index}.{name}"].T

    return LayerWeights(attn_norm=arrays[f"{index}.attn_norm"], wqkv=matrix("wqkv"), wo=matrix("wo"),
                        ffn_norm=arrays[f"{index}.ffn_norm"], w_gate_up=matrix("w_gate_up"), w_down=matrix("w_down"),
                        **{name: arrays.get(f"{index}.{name}") for name in OPTIONAL_VECTORS})


def _mapped(folder: Path, name: str, shape: list[int], dtype: str) -> np.ndarray:
    array = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
    if list(array.shape) != shape or array.dtype.str != dtype or not array.flags.c_contiguous:
        raise ValueError(f"cached {name} is {array.dtype}{array.shape}, the manifest says {dtype}{shape}")
    return array.view(np.ndarray)  # plain ndarray slicing: memmap's per-slice bookkeeping is slow


def _trim(root: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
                     key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for stale in entries[MAX_ENTRIES:]:
        shutil.rmtree(stale, ignore_errors=True)

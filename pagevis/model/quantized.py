"""Weights kept as the GGUF stores them: each matrix's quantised blocks repacked at load into row tiles (still 4, 5
or 8 bits a weight, see weight_kernels.py), multiplied by activations without a float32 copy of the matrix.

`QuantMatrix` stands where a float32 (in, out) weight view stood: `x @ matrix` works (NumPy defers to
`__rmatmul__`), `matrix.rows(ids)` gives dequantised output rows (the embedding lookup). Its product: one row ->
the format's matrix-vector kernel; up to SMALL_BATCH rows -> the small-batch kernel (each group dequantised once for
all rows); more -> tiles dequantised a chunk at a time into a float32 buffer and multiplied by BLAS sgemm
(prefill). F32, F16 and BF16 tensors stay float32 arrays (BLAS).

The ggml block layouts (what each decoder below reads) are ggml's, as gguf-py's `gguf.quants` dequantises them;
the tests check every type against that dequantiser.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from pagevis.model.weight_threads import split

TILE = 64
# rows up to which the small-batch kernel beats dequantise-then-sgemm (pagevis bench weights, SmolLM2: 8 and 16 yes)
SMALL_BATCH = 16
CHUNK_BYTES = 2 << 20  # float32 bytes of dequantised weights per sgemm chunk, for many rows (prefill)
# For a batch of a few rows the chunk must stay in L2 (1 MB here) between being written and read: 256 KB made
# 16 sequences' aggregate decode 1.2x faster than 2 MB (SmolLM2: 113-119 against 88-100 tokens/s)
SMALL_CHUNK_BYTES, SMALL_CHUNK_ROWS = 256 << 10, 64
REPACK_ROWS = 4096  # rows decoded at a time while repacking (bounds the temporary codes)
QK_K = 256

# ggml type -> (packed format, weights per group, bytes per block, weights per block)
FORMATS = {
    Q.Q4_0: ("u4", 32, 18, 32), Q.Q4_1: ("u4", 32, 20, 32), Q.Q4_K: ("u4", 32, 144, QK_K),
    # Q5_0 as signed bytes (code - 16, no offset: 9 bits a weight for its 5.5): the i8 kernel reads it ~3x faster
    # than u5's bit-by-bit high bits, which matters where Q5_0 holds most matrices (Gemma 3's Q4_K_M)
    Q.Q5_0: ("i8", 32, 22, 32), Q.Q5_1: ("u5", 32, 24, 32), Q.Q5_K: ("u5", 32, 176, QK_K),
    Q.Q8_0: ("i8", 32, 34, 32), Q.Q6_K: ("i8", 16, 210, QK_K),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
NO_HIGH_BITS = np.zeros((1, 1, 1), np.uint32)  # u4's placeholder for u5's high bits (never read)


def kernels() -> dict:
    """The kernels by packed format, imported on first use. Importing compiles them when numba's on-disk cache does
    not hold them yet (a first launch, a new numba or CPU): that is said on stderr, as it takes ~15-30 s."""
    global _KERNELS
    if _KERNELS is None:
        import numba

        from pagevis.model import weight_kernels as module  # noqa: F401  (below: its file's identity)
        _KERNELS = module.KERNELS
        stamp = _kernel_stamp(numba.__version__)
        if stamp is not None:
            stamp[0].write_text(stamp[1])
    return _KERNELS


def announce_compiling() -> None:
    """Say on stderr that the kernels are about to be compiled, if they are not in the on-disk cache yet."""
    import importlib.metadata
    import sys

    if _KERNELS is not None:
        return
    try:
        version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        return
    stamp = _kernel_stamp(version)
    if stamp is not None and (not stamp[0].exists() or stamp[0].read_text() != stamp[1]):
        print("pagevis: compiling the quantized-weight kernels (numba, once: its on-disk cache keeps them; "
              "about 15-30 s)", file=sys.stderr, flush=True)


def _kernel_stamp(numba_version: str):
    """(stamp file, what it holds once this kernel source was compiled with this numba on this CPU), or None."""
    import hashlib
    import os
    from pathlib import Path

    from pagevis.model.matmul import cache_dir, cpu_model

    source = Path(__file__).with_name("weight_kernels.py")
    try:
        stat = source.stat()
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    where = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]  # one per installed copy of the source
    return (folder / f"weight-kernels-{where}.stamp",
            f"{numba_version} {stat.st_size} {stat.st_mtime_ns} {cpu_model()} {os.cpu_count()}")


_KERNELS: dict | None = None


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are weights 0..15, high nibbles 16..31 (ggml's *_0, *_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, bit j for weight j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block (as gguf-py's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k4_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> 256 codes: each 32 bytes hold weights 0..31 of a 64 in low nibbles, 32..63 in high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, QK_K)


def decode_blocks(kind: Q, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(n, bytes per block) raw blocks -> codes (n, weights per block), scale and offset per group (n, groups):
    weight = scale * code + offset (offset None: 0). Codes are uint8 (int8 for i8 formats)."""
    n = len(blocks)
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _f16(blocks[:, 0:2])
        has_min = kind in (Q.Q4_1, Q.Q5_1)
        m = _f16(blocks[:, 2:4]) if has_min else None
        at = 4 if has_min else 2
        codes = None
        if kind in (Q.Q5_0, Q.Q5_1):
            codes = _high_bits(blocks[:, at:at + 4]) << 4
            at += 4
        nib = _nibbles(blocks[:, at:at + 16])
        codes = nib if codes is None else nib | codes
        if kind == Q.Q5_0:
            return codes.astype(np.int8) - np.int8(16), d, None
        if m is None:
            m = d * np.float32(-8)
        return codes, d, m
    if kind == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks[:, 0:2]), None
    if kind in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        codes = _k4_codes(blocks[:, -128:])
        if kind == Q.Q5_K:
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((qh & 1).reshape(n, QK_K) << 4)
        return codes, d * sc, -(dmin * mn)
    if kind == Q.Q6_K:
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (ql & 15).reshape(n, 8, 32) | ((qh & 3).reshape(n, 8, 32) << 4)
        codes = q.reshape(n, QK_K).astype(np.int8) - np.int8(32)
        scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
        return codes, _f16(blocks[:, 208:210]) * scales, None
    raise ValueError(f"no decoder for ggml type {kind.name}")


@dataclass
class QuantMatrix:
    """An (out, in) weight matrix in a packed format, used as its (in, out) view: `x @ matrix`."""

    kind: Q            # the ggml type it came from
    fmt: str           # u4, u5, i8
    n_out: int
    n_in: int
    arrays: tuple      # the kernel's arguments: (qs, qh, d, m, has high bits) or (qs, d)
    file_bytes: int    # its size in the GGUF file

    __array_ufunc__ = None  # `x @ matrix` calls __rmatmul__

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_in, self.n_out)

    @property
    def dtype(self):
        return np.dtype(np.float32)

    @property
    def size(self) -> int:
        return self.n_in * self.n_out

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        """Bytes held (and read per product): the packed codes, scales and offsets."""
        return sum(a.nbytes for a in self.arrays if isinstance(a, np.ndarray) and a is not NO_HIGH_BITS)

    @property
    def tiles(self) -> int:
        return self.arrays[0].shape[0]

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.product(np.asarray(x, dtype=np.float32))

    def product(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == 2 and len(x) == 1:
            return self.product(x[0])[None]
        matvec, matmul, _ = kernels()[self.fmt]
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 2 and len(x) > SMALL_BATCH:
            return self._sgemm(x)
        out = np.empty((*x.shape[:-1], self.tiles * TILE), np.float32)
        kernel = matvec if x.ndim == 1 else matmul

        def work(t0: int, t1: int, private: bool) -> np.ndarray:
            target = np.empty((*x.shape[:-1], (t1 - t0) * TILE), np.float32) if private else out[..., t0 * TILE:t1 * TILE]
            kernel(*self.arrays, x, t0, t1, target)
            return target

        def place(t0: int, t1: int, part: np.ndarray) -> None:
            out[..., t0 * TILE:t1 * TILE] = part

        split(self.tiles, self.nbytes, work, place)
        return out[..., :self.n_out]

    def _sgemm(self, x: np.ndarray) -> np.ndarray:
        """Chunks of tiles dequantised into a float32 buffer and multiplied by BLAS (many rows: prefill)."""
        dequant = kernels()[self.fmt][2]
        chunk = SMALL_CHUNK_BYTES if len(x) <= SMALL_CHUNK_ROWS else CHUNK_BYTES
        step = max(1, chunk // (4 * self.n_in * TILE))
        out = np.empty((len(x), self.tiles * TILE), np.float32)

        def work(t0: int, t1: int, private: bool) -> np.ndarray:
            target = np.empty((len(x), (t1 - t0) * TILE), np.float32) if private else out[:, t0 * TILE:t1 * TILE]
            buffer = np.empty((self.n_in, min(step, t1 - t0) * TILE), np.float32)
            for c0 in range(t0, t1, step):
                c1 = min(t1, c0 + step)
                whole = (c1 - c0) * TILE == buffer.shape[1]
                part = buffer if whole else np.empty((self.n_in, (c1 - c0) * TILE), np.float32)
                dequant(*self.arrays, c0, c1, part)
                np.matmul(x, part, out=target[:, (c0 - t0) * TILE:(c1 - t0) * TILE])
            return target

        def place(t0: int, t1: int, part: np.ndarray) -> None:
            out[:, t0 * TILE:t1 * TILE] = part

        split(self.tiles, self.nbytes * len(x), work, place)
        return out[:, :self.n_out]

    def dequantize(self, t0: int = 0, t1: int | None = None) -> np.ndarray:
        """Tiles t0..t1 as float32 (in, rows)."""
        t1 = self.tiles if t1 is None else t1
        out = np.empty((self.n_in, (t1 - t0) * TILE), np.float32)
        kernels()[self.fmt][2](*self.arrays, t0, t1, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Output rows ids, dequantised: (len(ids), in) float32 (the embedding's lookup)."""
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((len(ids), self.n_in), np.float32)
        tiles: dict[int, np.ndarray] = {}
        for i, row in enumerate(ids.tolist()):
            tile = row // TILE
            if tile not in tiles:
                tiles[tile] = self.dequantize(tile, tile + 1)
            out[i] = tiles[tile][:, row % TILE]
        return out


def pack(kind: Q, raw_rows: np.ndarray, n_in: int) -> QuantMatrix:
    """Repack a quantised (out, in) matrix from its raw GGUF rows (out, bytes per row) into TILE-row tiles."""
    if kind not in FORMATS:
        raise ValueError(f"ggml type {kind.name} has no packed format")
    fmt, group, block_bytes, block_weights = FORMATS[kind]
    n_out = len(raw_rows)
    blocks_per_row = n_in // block_weights
    if n_in % block_weights or raw_rows.shape[1] != blocks_per_row * block_bytes:
        raise ValueError(f"{kind.name} rows of {n_in} weights take {blocks_per_row} blocks of {block_bytes} bytes; "
                         f"got rows of {raw_rows.shape[1]} bytes")
    tiles, groups = -(-n_out // TILE), n_in // group
    code_type = np.int8 if fmt == "i8" else np.uint8
    qs = np.zeros((tiles, groups, group // 2 if fmt != "i8" else group, TILE), code_type)
    qh = np.zeros((tiles, groups, TILE), np.uint32) if fmt == "u5" else None
    d = np.zeros((tiles, groups, TILE), np.float32)
    m = np.zeros((tiles, groups, TILE), np.float32) if fmt != "i8" else None
    step = REPACK_ROWS // TILE * TILE
    for start in range(0, n_out, step):
        rows = raw_rows[start:start + step]
        n = len(rows)
        codes, scale, offset = decode_blocks(kind, np.ascontiguousarray(rows).reshape(n * blocks_per_row, -1))
        codes = codes.reshape(n, groups, group)
        t0, t_n = start // TILE, -(-n // TILE)
        pad = t_n * TILE - n

        def tiled(a: np.ndarray) -> np.ndarray:  # (n, groups, ...) -> (tiles, groups, ..., TILE)
            a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a
            a = a.reshape(t_n, TILE, *a.shape[1:])
            return np.moveaxis(a, 1, -1)

        if fmt == "i8":
            qs[t0:t0 + t_n] = tiled(codes)
        else:
            qs[t0:t0 + t_n] = tiled((codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4))
            m[t0:t0 + t_n] = tiled(offset.reshape(n, groups))
        if fmt == "u5":
            bits = (codes >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            qh[t0:t0 + t_n] = tiled(np.bitwise_or.reduce(bits, axis=-1))
        d[t0:t0 + t_n] = tiled(scale.reshape(n, groups))
    arrays = {"u4": (qs, NO_HIGH_BITS, d, m, False), "u5": (qs, qh, d, m, True), "i8": (qs, d)}[fmt]
    return QuantMatrix(kind, fmt, n_out, n_in, arrays, int(raw_rows.nbytes))

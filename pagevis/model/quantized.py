"""Weights kept as the GGUF stores them: each matrix's quantised blocks repacked at load into row tiles (still 4, 5
or 8 bits a weight, see weight_kernels.py), multiplied by activations without a float32 copy of the matrix.

`QuantMatrix` stands where a float32 (in, out) weight view stood: `x @ matrix` works (NumPy defers to
`__rmatmul__`), `matrix.rows(ids)` gives dequantised output rows (the embedding lookup). Its product: one row ->
the format's matrix-vector kernel; more -> batch_kernels.py's (each group's codes converted once for all rows; every
row bit for bit the matrix-vector kernel's), PREFILL_ROWS rows at a time past SMALL_BATCH (a prefill); the formats
it lacks (u5) take weight_kernels' small-batch kernel up to SMALL_BATCH rows, and beyond, tiles dequantised a chunk
at a time into a float32 buffer multiplied by BLAS sgemm. F32, F16 and BF16 tensors stay float32 arrays (BLAS).

Held as the file holds them: the codes (Q5_0 widened to bytes), each block's float16 scales as their bits, the K
types' 6- or 8-bit sub-scales as bytes; 4.5 bits a weight for Q4_0, 5 for Q4_1, 6 for Q5_1, 8.5 for Q8_0 and Q5_0,
4.625 for Q4_K, 5.625 for Q5_K, 8.5625 for Q6_K. The repack kernels (weight_kernels.py) read ggml's block layouts as
gguf-py's `gguf.quants` dequantises them (the tests check every type against that dequantiser), straight into
the packed arrays: nothing a tensor's size is allocated besides them.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from pagevis.kernel_loader import import_kernels
from pagevis.model import int8_rows
from pagevis.model.matrix_descriptor import describe
from pagevis.model.matrix_descriptor import family as matrix_family
from pagevis.model.resident import release_compiler_pages, release_mapped, release_whole_pages
from pagevis.model.weight_threads import split, weight_threads

if TYPE_CHECKING:
    from pagevis.model.spin_pool import SpinPool

TILE = 64
# rows up to which the small-batch kernel beats dequantise-then-sgemm (pagevis bench weights, SmolLM2: 8 and 16 yes)
SMALL_BATCH = 16
# More rows (a prefill) go through batch_kernels.py's kernel this many at a time, where it has one (u4, i8): every
# row then equals the row alone bit for bit, and a 512-token prompt's products took 0.51 s of CPU against
# dequantise-then-sgemm's 0.87 (Gemma 3 270M; SmolLM2 0.63 against 1.02; 32 and 128 rows alike, all 512 at once 0.56)
PREFILL_ROWS = 64
# formats batch_kernels has a rows kernel for (`rows`, a family's rows_kernel: u4 = Q4_0, Q4_1, Q4_K; i8 = Q8_0, Q5_0,
# Q6_K, the types SmolLM2's and Gemma 3's files hold), for 2 to SMALL_BATCH rows and a prefill's; the spin pool's
# helper shares their prefill rows on two threads (PREFILL_ROWS rows a block, each block's tiles in chunks:
# spin_pool.product_rows). Others (u5: Q5_1, Q5_K) take weight_kernels' small-batch kernel and weight_threads.split
POOL_ROWS = ("u4", "i8")
CHUNK_BYTES = 2 << 20  # float32 bytes of dequantised weights per sgemm chunk, for many rows (prefill)
# For a batch of a few rows the chunk must stay in L2 (1 MB here) between being written and read: 256 KB made
# 16 sequences' aggregate decode 1.2x faster than 2 MB (SmolLM2: 113-119 against 88-100 tokens/s)
SMALL_CHUNK_BYTES, SMALL_CHUNK_ROWS = 256 << 10, 64
ALIGN = 64  # bytes: every packed array starts on a cache line (aligned_empty; the kernels read 64-byte lines)
REPACK_ROWS = 4096  # rows repacked before their pages of the file mapping are dropped (bounds what is resident)
QK_K = 256

# ggml type -> (packed format, weights per group, bytes per block, weights per block)
FORMATS = {
    Q.Q4_0: ("u4", 32, 18, 32), Q.Q4_1: ("u4", 32, 20, 32), Q.Q4_K: ("u4", 32, 144, QK_K),
    # Q5_0 as signed bytes (code - 16, no offset: 8.5 bits a weight for its 5.5): the i8 kernel reads it ~3x faster
    # than u5's bit-by-bit high bits, which matters where Q5_0 holds most matrices (Gemma 3's Q4_K_M)
    Q.Q5_0: ("i8", 32, 22, 32), Q.Q5_1: ("u5", 32, 24, 32), Q.Q5_K: ("u5", 32, 176, QK_K),
    Q.Q8_0: ("i8", 32, 34, 32), Q.Q6_K: ("i8", 16, 210, QK_K),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# placeholders for arrays a format does not use (u4's high bits, plain types' 6-bit scales, Q4_0's offsets)
NO_U32, NO_I16, NO_I8 = np.zeros((1, 1, 1), np.uint32), np.zeros((1, 1, 1), np.int16), np.zeros((1, 1, 1), np.int8)
PLACEHOLDERS = (NO_U32, NO_I16, NO_I8)
HALF, Q4_0_MODE, SUPER = 0, 1, 2  # the kernels' scale modes (weight_kernels.py)
# weight_kernels' kernels by format, of those compiled on demand (weight_kernel): u5's rows, the sgemm's dequantisers
MATMUL, DEQUANT = {"u5": "nib_matmul"}, {"u4": "nib_dequant", "u5": "nib_dequant", "i8": "i8_dequant"}


def kernels() -> dict:
    """The kernels by packed format, imported on first use: loaded from numba's on-disk cache, or compiled (a few
    seconds: a first launch, a new numba or CPU; said on stderr when numba starts compiling, not before; the kernels a
    model's products call compile on demand: family_kernel, weight_kernel), through
    kernel_loader.import_kernels: under the compile lock, a damaged cache healed, in memory where numba cannot cache
    or another process holds the lock too long, each said in one line."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = import_kernels("pagevis.model.weight_kernels", "the quantized-weight kernels", seconds=3).KERNELS
        release_compiler_pages()  # linked: the compiler's code is not run again
    return _KERNELS


_KERNELS: dict | None = None


def weight_kernel(name: str):
    """weight_kernels' kernel `name` of its LAZY ones (the sgemm's dequantisers, the repack kernels, u5's rows),
    compiled or loaded from numba's cache the first time it is needed, through kernel_loader.import_kernels (under the
    compile lock, a damaged cache healed): a first launch compiles the ones its model's file uses (a second or two
    each here)."""
    return import_kernels("pagevis.model.weight_kernels", f"the quantized-weight kernels ({name})", part=name,
                          build=lambda module: module.compiled(name))


def _rows_kernel():
    """batch_kernels.rows (a weight read once for every row), the kernel of POOL_ROWS' formats' rows."""
    global _ROWS_KERNEL
    if _ROWS_KERNEL is None:
        _ROWS_KERNEL = _batch_kernels().rows
        release_compiler_pages()  # loading them linked again: ~9 MiB of llvmlite's code back in, out again
    return _ROWS_KERNEL


def _batch_kernels():
    """batch_kernels.py, through kernel_loader.import_kernels (its rows kernels compile on demand: rows_kernel)."""
    return import_kernels("pagevis.model.batch_kernels", "the batched weight kernels")


def family_kernel(descriptor: np.ndarray, one_row: bool) -> int:
    """The address of batch_kernels' rows kernel for the matrix's family (matrix_descriptor.family), or with one_row
    its matrix-vector kernel, compiled or loaded the first time a matrix of that family needs it (_family_address)."""
    return _family_address(matrix_family(descriptor), one_row)


def _family_address(family: str, one_row: bool) -> int:
    """A family's kernel's address through kernel_loader.import_kernels (under the compile lock, a damaged cache
    healed), once a process: a first launch compiles only the families its model's file holds (a few seconds each
    here; SmolLM2 two, Gemma 3 three)."""
    if (one_row, family) not in _FAMILY_KERNELS:
        what, part = ("matrix-vector kernel", f"row-{family}") if one_row else ("rows kernel", family)
        _FAMILY_KERNELS[one_row, family] = import_kernels(
            "pagevis.model.batch_kernels", f"the weights' {what} ({family})", part=part, seconds=5,
            build=lambda module: module.rows_kernel(family, one_row))
        release_compiler_pages()
    return _FAMILY_KERNELS[one_row, family]


def preload_families(families: tuple[str, ...] = ("u4", "i8")) -> None:
    """The matrix-vector and rows kernels of these families (matrix_descriptor.family's names; by default SmolLM2's,
    Q4_1 and Q8_0) compiled or loaded now, as the first products would: the test suite's background loader."""
    for family in families:
        _family_address(family, True)
        if family not in ("u5", "q5_k"):  # u5's rows: weight_kernels' nib_matmul
            _family_address(family, False)


def preload_matrices(matrices) -> None:
    """The kernels these matrices' products call (their families', preload_families) compiled or loaded now, not at
    their first product: a model's load (gguf_loader), so its first step compiles nothing."""
    preload_families(tuple(sorted({matrix_family(m.descriptor) for m in matrices if isinstance(m, QuantMatrix)})))


_ROWS_KERNEL: Any = None
_FAMILY_KERNELS: dict[tuple[bool, str], int] = {}  # (one_row, family) -> its kernel's address, once loaded


def spin_pool():
    """The second thread of one-row (decode) products, or None on one thread (spin_pool.py: it waits in numba code
    for products, without the GIL and without a wake-up per product, so every layer's small products are shared;
    weight_threads.split hands a Python thread only products big enough to pay for waking it). Started on the
    first product with two threads; its kernels compiled or loaded through kernel_loader.import_kernels."""
    global _POOL, _POOL_FAILED
    if weight_threads() < 2 or _POOL_FAILED:
        return None
    if _POOL is None:
        try:
            _POOL = import_kernels("pagevis.model.spin_pool", "the weights' second thread", seconds=10).new_pool()
            release_compiler_pages()  # the pool's kernels loaded: llvmlite's code and their IR out again
        except Exception as exc:  # numba could neither load nor compile it: one thread's products, said once
            import sys

            _POOL_FAILED = True
            print(f"pagevis: the weights' second thread is unavailable ({type(exc).__name__}: {exc}); one-row "
                  "products stay on one thread", file=sys.stderr, flush=True)
            return None
    return _POOL


def running_spin_pool():
    """spin_pool() where the weights have started it (a packed model's products on two threads), else None, never
    starting it: what batched decode attention shares its sequences with. A float32 model's batches (the synthetic
    model's: the tests', a first launch's) then never wait for the spin pool's kernels to compile (~10 s of CPU,
    ~70 with the weights' others, kernel_loader.FAMILIES), for attention a second thread barely helps at that size."""
    return _POOL if _POOL is not None and weight_threads() >= 2 else None


def _forget_pool_in_child() -> None:
    global _POOL
    _POOL = None  # a forked child has no helper thread: it starts its own on its first product


_POOL: SpinPool | None = None
_POOL_FAILED = False
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


@dataclass
class QuantMatrix:
    """An (out, in) weight matrix in a packed format, used as its (in, out) view: `x @ matrix`."""

    kind: Q            # the ggml type it came from
    fmt: str           # u4, u5, i8
    n_out: int
    n_in: int
    arrays: tuple      # the kernels' arguments: (qs, qh, dh, ds, mh, ms, high, per, mode) or (qs, dh, ds, per)
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

    @cached_property
    def nbytes(self) -> int:
        """Bytes held (and read per product): the packed codes, scales and offsets."""
        return sum(a.nbytes for a in self.arrays if isinstance(a, np.ndarray) and all(a is not p for p in PLACEHOLDERS))

    @cached_property
    def descriptor(self) -> np.ndarray:
        """The kernel's arrays as addresses and shapes, for spin_pool.product (the helper thread's view of them) and
        batch_kernels' rows kernel (matrix_descriptor.py: plain NumPy, no kernel loaded)."""
        return describe(self.fmt, self.arrays, self.n_in)

    @cached_property
    def rows_address(self) -> int:
        """The address of its family's rows kernel (u4, i8: family_kernel), compiled on first use."""
        return family_kernel(self.descriptor, False)

    @cached_property
    def row_address(self) -> int:
        """The address of its family's matrix-vector kernel (family_kernel), compiled on first use."""
        return family_kernel(self.descriptor, True)

    @property
    def tiles(self) -> int:
        return self.arrays[0].shape[0]

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.product(np.asarray(x, dtype=np.float32))

    def product(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == 2 and int8_rows.active():  # the rows the engine chose for int8 (model/int8_rows.py)
            x = np.ascontiguousarray(x, dtype=np.float32)
            if (int8 := int8_rows.product(self, x, spin_pool())) is not None:
                return int8
        if x.ndim == 2 and len(x) == 1:
            return self.product(x[0])[None]
        x = np.ascontiguousarray(x, dtype=np.float32)
        many = x.ndim == 2 and len(x) > SMALL_BATCH  # a prefill's rows: PREFILL_ROWS at a time
        if many and self.fmt in POOL_ROWS and (pool := spin_pool()) is not None:  # two threads: the spin pool's
            out = np.empty((len(x), self.tiles * TILE), np.float32)
            pool.product_rows(self.rows_address, self.descriptor, self.arrays, x, out)
            return out[:, :self.n_out]
        rows = _rows_kernel() if x.ndim == 2 and self.fmt in POOL_ROWS else None
        if x.ndim == 2 and len(x) > SMALL_BATCH and rows is None:
            return self._sgemm(x)
        out = np.empty((*x.shape[:-1], self.tiles * TILE), np.float32)
        if x.ndim == 1 and len(x) == self.n_in and (pool := spin_pool()) is not None:
            pool.product(self.row_address, self.descriptor, self.arrays, x, out)  # shared with the second thread
            return out[:self.n_out]
        if x.ndim == 1:  # batch_kernels' take its family's kernel and the matrix's descriptor
            kernel, arrays = _batch_kernels().row, (self.row_address, self.descriptor)
        elif rows:
            kernel, arrays = rows, (self.rows_address, self.descriptor)
        else:
            kernel, arrays = weight_kernel(MATMUL[self.fmt]), self.arrays

        def work(t0: int, t1: int, private: bool) -> np.ndarray:
            target = np.empty((*x.shape[:-1], (t1 - t0) * TILE), np.float32) if private else out[..., t0 * TILE:t1 * TILE]
            if many:
                for i in range(0, len(x), PREFILL_ROWS):
                    kernel(*arrays, x[i:i + PREFILL_ROWS], t0, t1, target[i:i + PREFILL_ROWS])
            else:
                kernel(*arrays, x, t0, t1, target)
            return target

        def place(t0: int, t1: int, part: np.ndarray) -> None:
            out[..., t0 * TILE:t1 * TILE] = part

        split(self.tiles, self.nbytes * (len(x) if many else 1), work, place)
        return out[..., :self.n_out]

    def _sgemm(self, x: np.ndarray) -> np.ndarray:
        """Chunks of tiles dequantised into a float32 buffer and multiplied by BLAS (many rows: prefill)."""
        dequant = weight_kernel(DEQUANT[self.fmt])
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
        weight_kernel(DEQUANT[self.fmt])(*self.arrays, t0, t1, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Output rows ids, dequantised: (len(ids), in) float32 (the embedding's lookup)."""
        ids = np.asarray(ids).reshape(-1)
        if len(ids) == 1 and self.fmt == "i8" and self.arrays[3] == 1:  # a decode step's one Q8_0 row: not its tile
            qs, dh = self.arrays[:2]
            tile, r = divmod(int(ids[0]), TILE)
            # d * code in float32, as the kernels' dequantiser forms it (the same bits)
            return np.multiply(qs[tile, :, :, r], dh[tile, :, r].view(np.float16).astype(np.float32)[:, None],
                               dtype=np.float32).reshape(1, self.n_in)
        out = np.empty((len(ids), self.n_in), np.float32)
        tiles: dict[int, np.ndarray] = {}
        for i, row in enumerate(ids.tolist()):
            tile = row // TILE
            if tile not in tiles:
                tiles[tile] = self.dequantize(tile, tile + 1)
            out[i] = tiles[tile][:, row % TILE]
        return out


def pack(kind: Q, raw_rows: np.ndarray | list[np.ndarray], n_in: int) -> QuantMatrix:
    """Repack a quantised (out, in) matrix from its raw GGUF rows (out, bytes per row) into TILE-row tiles; a list
    of raw matrices (Q, K, V of one type) is packed as one, their rows one after another. The file's pages of
    each REPACK_ROWS rows are dropped from the process once repacked (when the rows are a read-only file
    mapping), so a big tensor is never resident twice."""
    if kind not in FORMATS:
        raise ValueError(f"ggml type {kind.name} has no packed format")
    fmt, group, block_bytes, block_weights = FORMATS[kind]
    parts = [raw_rows] if isinstance(raw_rows, np.ndarray) else list(raw_rows)
    blocks_per_row = n_in // block_weights
    for part in parts:
        if n_in % block_weights or part.ndim != 2 or part.shape[1] != blocks_per_row * block_bytes:
            raise ValueError(f"{kind.name} rows of {n_in} weights take {blocks_per_row} blocks of {block_bytes} "
                             f"bytes; got rows of {part.shape[-1]} bytes")
    n_out = sum(len(part) for part in parts)
    tiles, groups = -(-n_out // TILE), n_in // group
    per = block_weights // group  # groups a float16 scale covers: 1, or a K type's super-block

    def held(dtype, n: int, *inner: int) -> np.ndarray:  # every row is written by the repack kernel but a last
        array = aligned_empty((tiles, n, *inner, TILE), dtype)  # tile's padding (np.zeros: memset reused memory)
        if n_out % TILE:
            array[-1] = 0
        return array

    qs = held(np.int8 if fmt == "i8" else np.uint8, groups, group if fmt == "i8" else group // 2)
    dh = held(np.int16, blocks_per_row)  # float16 bits
    ds = held(np.int8, groups) if per > 1 else NO_I8
    if fmt == "i8":
        arrays: tuple = (qs, dh, ds, per)
    else:
        qh = held(np.uint32, groups) if fmt == "u5" else NO_U32
        mh = held(np.int16, blocks_per_row) if kind != Q.Q4_0 else NO_I16
        ms = held(np.int8, groups) if per > 1 else NO_I8
        mode = {Q.Q4_0: Q4_0_MODE, Q.Q4_K: SUPER, Q.Q5_K: SUPER}.get(kind, HALF)
        arrays = (qs, qh, dh, ds, mh, ms, fmt == "u5", per, mode)
    repack = weight_kernel("repack_i8" if fmt == "i8" else "repack_k" if per > 1 else "repack_nib")
    row0, inf_nan = 0, False
    for part in parts:
        for start in range(0, len(part), REPACK_ROWS):
            rows = np.ascontiguousarray(part[start:start + REPACK_ROWS], dtype=np.uint8)
            if fmt == "i8":
                inf_nan |= repack(rows, row0 + start, *arrays, {Q.Q8_0: 8, Q.Q5_0: 5, Q.Q6_K: 6}[kind])
            elif per > 1:
                inf_nan |= repack(rows, row0 + start, *arrays[:6], kind == Q.Q5_K)
            else:
                inf_nan |= repack(rows, row0 + start, *arrays[:6], block_bytes, kind != Q.Q4_0, fmt == "u5")
            _drop_pages(part[start:start + REPACK_ROWS])
        row0 += len(part)
    if inf_nan:  # the kernels' conversion (weight_kernels._half) is for finite halves
        raise ValueError("a block's float16 scale is infinite or NaN (the file's weights are not numbers)")
    return QuantMatrix(kind, fmt, n_out, n_in, arrays, sum(int(part.nbytes) for part in parts))


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose first byte is at a multiple of ALIGN: a byte buffer ALIGN - 1 bytes
    longer, viewed from its first aligned byte. np.empty's arrays start where malloc's block does (16-byte aligned):
    92 of SmolLM2's 121 code arrays started 16, 32 or 48 bytes into a cache line, so every 64-byte line of codes the
    kernels load straddled two. Measured on the Xeon (aligned against main's offsets in one process, alternated):
    no difference resolvable at load 2-3.5 (int8 rows and one-row products within +-3%), for ~23 KB of padding."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    buffer = np.empty(size + ALIGN - 1, np.uint8)
    start = -buffer.ctypes.data % ALIGN
    return buffer[start:start + size].view(dtype).reshape(shape)


def _drop_pages(rows: np.ndarray) -> None:
    """Drop the whole pages of rows from the process if they are a read-only file mapping."""
    place = _mapped_place(rows)
    if place is not None:
        owner, offset = place
        release_whole_pages(owner, offset, offset + rows.nbytes)


def file_pages_dropper(arrays: list[np.ndarray]):
    """A function that drops every page the arrays' span of a read-only file mapping has in the process, partial
    pages included (reading a page maps its neighbours too: fault-around), or None if they are not one."""
    places = [_mapped_place(a) for a in arrays]
    if not places or any(p is None or p[0] is not places[0][0] for p in places):
        return None
    owner = places[0][0]
    start = min(offset for _, offset in places) // mmap.PAGESIZE * mmap.PAGESIZE
    end = max(offset + a.nbytes for (_, offset), a in zip(places, arrays))
    return lambda: release_mapped(owner, start, end)


def _mapped_place(array: np.ndarray):
    """(the mmap, the array's offset in it) if the array is a read-only view of an open mmap, else None: MADV_DONTNEED
    on anything else (a private copy, the heap) could lose data, so nothing else is ever advised."""
    if array.flags.writeable or not array.flags.c_contiguous or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    owner = array.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if not isinstance(owner, mmap.mmap) or owner.closed:
        return None
    return owner, array.ctypes.data - np.frombuffer(owner, np.uint8, count=1).ctypes.data

"""Decode rows of several sequences multiplied in int8: the activations quantised per group of 32 inputs, integer
dot products with the packed weight codes (AVX-512 VNNI's vpdpbusd, int8_kernels.py), scaled once per group --
llama.cpp's arithmetic for its quantised types.

Where it applies: only inside `batched(True)`, which the engine enters for a forward whose rows are all decode rows
of two or more different sequences (engine.Engine._execute; BatchConfig.exact_batches turns it off) -- in a step
that also feeds a prompt chunk, for the decode rows only (`batched`'s masks) -- and only for rows times a u4 (Q4_0,
Q4_1, Q4_K) or i8 (Q8_0, Q5_0, Q6_K) matrix. Everything else -- one sequence, every prompt row, the float32 tensors,
u5 -- is the exact float32 product it always was (quantized.QuantMatrix.product).
A row's result then differs from the row alone: tests/test_int8_rows.py bounds it against float64 references.

The route is chosen once per process (`route()`): "vnni" where llvmlite reports avx512vnni for this CPU, else
"exact" (the float32 batch kernels: a CPU without the instruction could not run the compiled kernels at all); the
environment variable PAGEVIS_NO_VNNI=1 forces "exact" (tests, comparisons). `describe()` says which, for the benches.

Two weight threads: a big enough product's rows are quantised once and its tiles shared with the spin pool's helper
(int8_kernels.pool_kernel through spin_pool.product_kernel), each output column computed whole by one thread, so
the rows are bit for bit the one thread's; smaller ones stay on the caller (POOL_TILES).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from pagevis.kernel_loader import import_kernels
from pagevis.model.resident import release_compiler_pages
from pagevis.model.weight_threads import split

NO_VNNI_ENV = "PAGEVIS_NO_VNNI"
TILE = 64
XQ = 4  # int8_kernels.XQ: where a pool handle holds the quantised rows' three addresses
# Two weight threads: a product of POOL_TILES tiles or more (SmolLM2's feed-forward up and gate, the logits) goes
# to the spin pool, its tiles cut into POOL_CHUNKS chunks (spin_pool.product_kernel). 8 rows of a 1536 x 576 Q4_1
# matrix (24 tiles), the helper free (load ~1.1, best of 5 x 200): one thread 30.6 us, two 26.2-27.2 (any of 2, 4
# or 8 chunks; the kernel call alone 27.3 -> 19.4: the rest is quantising apart and the handle); 9 tiles 14.6 ->
# 15.9-16.6, 3 tiles 8.7 -> 11.2: those stay on the caller (weight_threads.split leaves them there too)
# A chunk holds at most POOL_CHUNK_TILES tiles (~20-25 us at 8 rows): a chunk the helper stalls on (its core went
# elsewhere) costs the caller about a chunk's time more, the logits' 4 chunks of 192 tiles ~300 us
POOL_TILES, POOL_CHUNKS, POOL_CHUNK_TILES = 16, 4, 16
_STATE = threading.local()


def host_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (vpdpbusd), as LLVM sees it (the compiler that would emit it)."""
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("avx512vnni"))
    except Exception:  # no feature list on this platform: assume the instruction is missing
        return False


@functools.cache
def route() -> str:
    """"vnni" (int8 rows) or "exact" (float32 rows), decided once per process."""
    if os.environ.get(NO_VNNI_ENV, "") not in ("", "0") or not host_has_vnni():
        return "exact"
    return "vnni"


def describe() -> str:
    """One line for the benches: which arithmetic several sequences' decode rows use on this machine."""
    if route() == "vnni":
        return ("batched decode rows: int8 activations x packed codes, integer dot products (AVX-512 VNNI "
                "vpdpbusd); --exact-batches keeps them float32")
    why = "PAGEVIS_NO_VNNI is set" if host_has_vnni() else "this CPU has no avx512_vnni"
    return f"batched decode rows: exact float32 ({why})"


@contextmanager
def batched(on: bool, masks: tuple[np.ndarray, ...] = ()) -> Iterator[None]:
    """Products inside take int8 rows (on, where the route is "vnni") on this thread; nested calls restore. masks:
    for a step that feeds prompt rows too, which rows are decode rows, one boolean mask per row count the forward
    multiplies (its token rows, its logit rows): a product of such a count takes int8 for its masked rows only
    and the exact kernels for the others (each row of those is the row alone, so a prompt's rows are what they
    are in an all-exact step), a product of another count stays exact; no masks: every row in int8."""
    previous = getattr(_STATE, "on", False), getattr(_STATE, "masks", None)
    _STATE.on = bool(on) and route() == "vnni"
    _STATE.masks = {len(mask): mask for mask in masks} if masks else None
    try:
        yield
    finally:
        _STATE.on, _STATE.masks = previous


def active() -> bool:
    return getattr(_STATE, "on", False)


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = import_kernels("pagevis.model.int8_kernels", "the int8 batch kernels",
                                  build=lambda module: module.compiled(), seconds=10)
        release_compiler_pages()
    return _KERNELS


_KERNELS: dict | None = None


def pool_handle(matrix, x: np.ndarray) -> np.ndarray:
    """int8_kernels.pool_kernel's handle of the rows x (quantised here, once for both threads) times matrix."""
    kernels = _kernels()
    if (handle := getattr(matrix, "int8_handle", None)) is None:  # the matrix's part, built once
        handle = matrix.int8_handle = kernels["handle"](matrix.fmt, matrix.arrays, matrix.n_in)
    handle = handle.copy()
    quantised, handle[XQ:XQ + 3] = _quantised(len(x), matrix.n_in, 16 if matrix.fmt == "i8" and matrix.arrays[3] > 1
                                              else 32)
    kernels["quantise_into"](x, *quantised)
    return handle


def _quantised(rows: int, n_in: int, size: int) -> tuple[tuple, tuple]:
    """This thread's arrays for rows quantised (int8_kernels.quantize's: codes, scales, sums of each group of size
    inputs) and their addresses: kept for good (small), so a late helper never reads freed memory."""
    buffers = _STATE.__dict__.setdefault("buffers", {})
    if (key := (rows, n_in, size)) not in buffers:
        arrays = (np.empty((rows, n_in), np.int8), np.empty((rows, n_in // 32), np.float32),
                  np.empty((rows, n_in // size), np.int32))
        buffers[key] = arrays, tuple(array.ctypes.data for array in arrays)
    return buffers[key]


def product(matrix, x: np.ndarray, pool=None) -> np.ndarray | None:
    """x (rows, in) float32 C-contiguous times a packed matrix (quantized.QuantMatrix) inside `batched(True)`:
    (rows, n_out), the decode rows in int8; None where this format, row count or mask leaves every row exact (the
    caller takes its exact path). pool: the spin pool (two weight threads) or None."""
    if matrix.fmt not in ("u4", "i8"):
        return None
    masks = getattr(_STATE, "masks", None)
    if masks is None:
        return _int8(matrix, x, pool) if len(x) > 1 else None
    mask = masks.get(len(x))
    if mask is None or np.count_nonzero(mask) < 2:
        return None
    out = np.empty((len(x), matrix.n_out), np.float32)
    with batched(False):
        out[~mask] = matrix.product(np.ascontiguousarray(x[~mask]))
    out[mask] = _int8(matrix, np.ascontiguousarray(x[mask]), pool)
    return out


def _int8(matrix, x: np.ndarray, pool) -> np.ndarray:
    kernels, arrays, tiles = _kernels(), matrix.arrays, matrix.tiles
    out = np.empty((len(x), tiles * TILE), np.float32)
    if tiles >= POOL_TILES and pool is not None and kernels["pool"] and pool.helping():  # two threads: the spin pool's helper takes tiles too
        pool.product_kernel(kernels["pool"], matrix.descriptor, arrays, pool_handle(matrix, x), out,
                            max(POOL_CHUNKS, -(-tiles // POOL_CHUNK_TILES)))
        return out[:, :matrix.n_out]
    kernel = kernels[matrix.fmt]

    def work(t0: int, t1: int, private: bool) -> np.ndarray:
        target = np.empty((len(x), (t1 - t0) * TILE), np.float32) if private else out[:, t0 * TILE:t1 * TILE]
        kernel(*arrays, x, t0, t1, target)
        return target

    def place(t0: int, t1: int, part: np.ndarray) -> None:
        out[:, t0 * TILE:t1 * TILE] = part

    split(tiles, matrix.nbytes, work, place)
    return out[:, :matrix.n_out]

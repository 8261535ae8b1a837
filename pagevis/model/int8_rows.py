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


def product(matrix, x: np.ndarray) -> np.ndarray | None:
    """x (rows, in) float32 C-contiguous times a packed matrix (quantized.QuantMatrix) inside `batched(True)`:
    (rows, n_out), the decode rows in int8; None where this format, row count or mask leaves every row exact (the
    caller takes its exact path)."""
    if matrix.fmt not in ("u4", "i8"):
        return None
    masks = getattr(_STATE, "masks", None)
    if masks is None:
        return _int8(matrix, x) if len(x) > 1 else None
    mask = masks.get(len(x))
    if mask is None or np.count_nonzero(mask) < 2:
        return None
    out = np.empty((len(x), matrix.n_out), np.float32)
    with batched(False):
        out[~mask] = matrix.product(np.ascontiguousarray(x[~mask]))
    out[mask] = _int8(matrix, np.ascontiguousarray(x[mask]))
    return out


def _int8(matrix, x: np.ndarray) -> np.ndarray:
    kernel, arrays, tiles = _kernels()[matrix.fmt], matrix.arrays, matrix.tiles
    out = np.empty((len(x), tiles * TILE), np.float32)

    def work(t0: int, t1: int, private: bool) -> np.ndarray:
        target = np.empty((len(x), (t1 - t0) * TILE), np.float32) if private else out[:, t0 * TILE:t1 * TILE]
        kernel(*arrays, x, t0, t1, target)
        return target

    def place(t0: int, t1: int, part: np.ndarray) -> None:
        out[:, t0 * TILE:t1 * TILE] = part

    split(tiles, matrix.nbytes, work, place)
    return out[:, :matrix.n_out]

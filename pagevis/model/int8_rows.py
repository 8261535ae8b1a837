"""Rows multiplied in int8: the activations quantised per group of 32 inputs, integer dot products with the packed
weight codes (AVX-512 VNNI's vpdpbusd, int8_kernels.py), scaled once per group -- llama.cpp's arithmetic for its
quantised types.

Where it applies: only inside `batched(True)`, which the engine enters for the rows its setting `int8_rows`
(BatchConfig; engine.batch.int8_rows_of) chooses: "none" -- no row; "batched" (the default of `pagevis run --n` and
the app) -- decode rows of two or more different sequences; "prompts" -- those and every prompt row, alone or beside
others; "all" -- every row, a lone sequence's decode row too. A request scoring its prompt (prompt_logprobs) keeps
its own rows exact whatever the setting. In a step whose rows are not all chosen, `batched`'s masks say which are (the others
take the exact kernels, each row as it is alone). Only rows times a u4 (Q4_0, Q4_1, Q4_K) or i8 (Q8_0, Q5_0, Q6_K)
matrix; the float32 tensors and u5 stay the exact float32 product (quantized.QuantMatrix.product).
An int8 row's result differs from the exact row: tests/test_int8_rows.py bounds it against float64 references. It
does not depend on the other rows of its product (each row is quantised and summed on its own, in one order).

The route is chosen once per process (`route()`): "vnni" where llvmlite reports avx512vnni for this CPU, else
"exact" (the float32 batch kernels: a CPU without the instruction could not run the compiled kernels at all); the
environment variable PAGEVIS_NO_VNNI=1 forces "exact" (tests, comparisons). `describe()` says which, for the benches.

Every product goes through one compiled call: the rows quantised into this thread's arrays (int8_kernels'
`_quantize_rows`), then its tiles multiplied (int8_kernels.pool_kernel) -- on one thread by int8_kernels.product, on
two by spin_pool.product_kernel, which quantises first and then shares the tiles with the spin pool's helper, each
output column computed whole by one thread, so the rows are bit for bit the one thread's.

Memory, bounded whatever the row counts (prompt chunks have any size): a product of more than MAX_ROWS (256) rows is
cut into pieces of at most MAX_ROWS, and a piece of n rows uses a handle and quantised arrays for `capacity(n)` rows,
the next power of two (1, 2, 4, ..., 256: 9 capacities). So each matrix keeps at most 9 handles (`int8_handles`, 3 words
each), and each thread at most 9 sets of quantised arrays per (input size, sum group) -- kept for good, so a
late helper never reads freed memory: under 2 x 256 x n_in x (1 + 4/32 + 4/size) bytes per input size, ~1.4 MiB a
thread for SmolLM2 (inputs 576 and 1536; tests/test_int8_prompt_rows.py measures it).
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

NO_VNNI_ENV = "PAGEVIS_NO_VNNI"
TILE = 64
# Two weight threads: a product goes to the spin pool cut by `chunks`, from its estimated time on one thread: a tile
# times a group of 32 inputs takes ~TILE_GROUP_NS[0] + TILE_GROUP_NS[1] ns a row (SmolLM2, one thread: 40 ns at 2 rows,
# 75 at 8, 130 at 16). Sharing costs the caller ~1-1.5 us (the post, a second kernel call, the wait for and copy of the
# helper's chunk; a chunk more ~0.2-0.3 us), so a product under SHARE_NS stays whole; others are cut into chunks of
# about CHUNK_NS, at least two: a chunk the helper stalls on (its core went elsewhere) costs the caller about a
# chunk's time more. A helper that is not spinning is offered few (spin_pool.STALE_NS)
TILE_GROUP_NS, SHARE_NS, CHUNK_NS = (25.0, 6.5), 4_000.0, 16_000.0
MAX_CHUNKS = 256  # spin_pool.MAX_CHUNKS (a job's chunk states)
MAX_ROWS = 256  # a product of more rows is cut into pieces of at most this many (the docstring's bound)
PLAN_ROWS = 32  # row counts up to this (decode batches) keep their plan on the matrix (`_plan`)
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
    """One line for the benches: which arithmetic the int8 rows (`int8_rows` setting) use on this machine."""
    if route() == "vnni":
        return ("batched decode rows: int8 activations x packed codes, integer dot products (AVX-512 VNNI "
                "vpdpbusd); --int8-rows says which rows take int8 (none: every row float32)")
    why = "PAGEVIS_NO_VNNI is set" if host_has_vnni() else "this CPU has no avx512_vnni"
    return f"batched decode rows: exact float32, as every row whatever --int8-rows says ({why})"


@contextmanager
def batched(on: bool, masks: tuple[np.ndarray, ...] = ()) -> Iterator[None]:
    """Products inside take int8 rows (on, where the route is "vnni") on this thread; nested calls restore. masks:
    for a step where only some rows are int8 (engine.batch.int8_rows_of), which rows are, one boolean mask per row
    count the forward multiplies (its token rows, its logit rows): a product of such a count takes int8 for its
    masked rows only and the exact kernels for the others (each row of those is the row alone, so such rows are
    what they are in an all-exact step), a product of another count stays exact; no masks: every row in int8, a
    product of one row too."""
    previous = getattr(_STATE, "on", False), getattr(_STATE, "masks", None)
    _STATE.on = bool(on) and route() == "vnni"
    _STATE.masks = {len(mask): mask for mask in masks} if masks and _STATE.on else None
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


def capacity(rows: int) -> int:
    """The rows a handle and its quantised arrays hold for a product of `rows` rows (at most MAX_ROWS): the next
    power of two, so the few capacities serve every row count (a kernel takes its row count apart from the handle,
    and the quantised arrays' row stride is the input size, so a capacity R serves any n <= R)."""
    return 1 << max(rows - 1, 0).bit_length()


def handle(matrix, rows: int) -> np.ndarray:
    """int8_kernels' handle of up to capacity(rows) rows times matrix (the addresses of this thread's arrays the rows
    are quantised into: `_quantised`; the matrix's own arrays: its descriptor), built once per matrix, capacity and
    thread and kept on the matrix."""
    return _entry(matrix, capacity(rows))[1]


def _entry(matrix, held: int) -> tuple:
    """(this thread's token, handle(), the quantised rows' arrays) of matrix and a capacity of `held` rows."""
    token = _STATE.__dict__.get("token")
    if token is None:
        token = _STATE.token = object()  # this thread's: a handle built by another thread holds that one's
    handles = matrix.__dict__.get("int8_handles")
    if handles is None:
        handles = matrix.int8_handles = {}
    entry = handles.get(held)
    if entry is None or entry[0] is not token:
        size = 16 if matrix.fmt == "i8" and matrix.arrays[3] > 1 else 32
        quantised = _quantised(held, matrix.n_in, size)
        entry = handles[held] = (token, _kernels()["handle"](quantised), quantised)
    return entry


def _quantised(held: int, n_in: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's arrays for up to `held` rows quantised (codes, scales, sums of each group of size inputs): kept
    for good, so a late helper never reads freed memory -- bounded, as `capacity` gives few sizes (the docstring)."""
    buffers = _STATE.__dict__.setdefault("buffers", {})
    if (key := (held, n_in, size)) not in buffers:
        buffers[key] = (np.empty((held, n_in), np.int8), np.empty((held, n_in // 32), np.float32),
                        np.empty((held, n_in // size), np.int32))
    return buffers[key]


def product(matrix, x: np.ndarray, pool=None) -> np.ndarray | None:
    """x (rows, in) float32 C-contiguous times a packed matrix (quantized.QuantMatrix) inside `batched(True)`:
    (rows, n_out), the rows the engine chose in int8 (every row, or a mask's); None where this format or row count
    leaves every row exact (the caller takes its exact path). pool: the spin pool (two weight threads) or None."""
    if matrix.fmt not in ("u4", "i8"):
        return None
    masks = getattr(_STATE, "masks", None)
    if masks is None:
        return _int8(matrix, x, pool)
    mask = masks.get(len(x))
    if mask is None or not mask.any():
        return None
    if mask.all():
        return _int8(matrix, x, pool)
    out = np.empty((len(x), matrix.n_out), np.float32)
    with batched(False):
        out[~mask] = matrix.product(np.ascontiguousarray(x[~mask]))
    out[mask] = _int8(matrix, np.ascontiguousarray(x[mask]), pool)
    return out


def _int8(matrix, x: np.ndarray, pool) -> np.ndarray:
    """The rows x in int8, in pieces of at most MAX_ROWS rows (a row's result is the same in any piece). A batched
    decode step makes ~120 of these calls with one row count: each matrix keeps, per row count up to PLAN_ROWS, this
    thread's handle and the product's chunks (`_plan`), so such a call is a lookup and one compiled call."""
    plans = matrix.__dict__.get("int8_plans")
    plan = None if plans is None else plans.get(len(x))
    if plan is None or plan[0] is not _STATE.__dict__.get("token"):
        if len(x) > PLAN_ROWS:
            return _pieces(matrix, x, pool)
        plan = _plan(matrix, len(x))
    kernels = _KERNELS or _kernels()
    out = np.empty((len(x), plan[2]), np.float32)
    if pool is not None and plan[3] > 1:
        pool.product_kernel(kernels["pool"], kernels["prepare"], matrix.descriptor, matrix.arrays, plan[1], x, out,
                            plan[3])
    else:  # one thread, or a product too small to share
        kernels["product"](matrix.descriptor, plan[1], x, out, kernels["pool"])
    return out if plan[4] else out[:, :matrix.n_out]


def _plan(matrix, rows: int) -> tuple:
    """(this thread's token, the handle, the output's width, chunks on two threads, whether the width is n_out) of
    rows (at most PLAN_ROWS) times matrix, kept on the matrix (`int8_plans`: at most PLAN_ROWS tuples, each holding
    a handle of `int8_handles`)."""
    token, h, _ = _entry(matrix, capacity(rows))
    plans = matrix.__dict__.get("int8_plans")
    if plans is None:
        plans = matrix.int8_plans = {}
    width = matrix.tiles * TILE
    plan = plans[rows] = (token, h, width, chunks(matrix.tiles, matrix.n_in // 32, rows), width == matrix.n_out)
    return plan


def _pieces(matrix, x: np.ndarray, pool) -> np.ndarray:
    """The rows x in int8, MAX_ROWS rows a piece (the handle and chunks looked up for each: prompt chunks)."""
    kernels = _kernels()
    out = np.empty((len(x), matrix.tiles * TILE), np.float32)
    for i in range(0, len(x), MAX_ROWS):
        rows, part = x[i:i + MAX_ROWS], out[i:i + MAX_ROWS]
        h = _entry(matrix, capacity(len(rows)))[1]
        count = 1 if pool is None else chunks(matrix.tiles, matrix.n_in // 32, len(rows))
        if count > 1:
            pool.product_kernel(kernels["pool"], kernels["prepare"], matrix.descriptor, matrix.arrays, h, rows, part,
                                count)
        else:  # one thread, or a product too small to share
            kernels["product"](matrix.descriptor, h, rows, part, kernels["pool"])
    return out[:, :matrix.n_out]


def chunks(tiles: int, groups: int, rows: int) -> int:
    """How many chunks a product of `rows` rows by `tiles` tiles of `groups` groups of 32 inputs is cut into for the
    spin pool's two threads (1: not shared)."""
    work = tiles * groups * (TILE_GROUP_NS[0] + TILE_GROUP_NS[1] * rows)
    return 1 if work < SHARE_NS else max(2, min(tiles, MAX_CHUNKS, round(work / CHUNK_NS)))

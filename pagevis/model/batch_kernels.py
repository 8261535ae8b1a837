"""Several rows times the packed weights: the kernels of a batched decode step (2 to quantized.SMALL_BATCH rows).

A weight read once serves every row, and each row's result is bit for bit the matrix-vector kernel's for that row
alone (weight_kernels.py), so a batched decode is the same arithmetic as decoding each sequence by itself. Per tile
of 64 output rows and group of G weights (32; Q6_K 16), the rows take their group sums in a register block of 16
zmm registers, and each row's sum is scaled into its output as the matrix-vector kernel scales it:
    out[i, r] += d[g, r] * (sum_j q[g, j, r] x[i, j]) + m[g, r] * (sum_j x[i, j])
each code times its input one FMA, in the matrix-vector kernel's order (both kernels' register blocks come from one
generator, tile_sums.sums); the codes (4-bit ones: weight j, then j + 16) are exact small integers in float32:
- up to FUSED_ROWS = 8 rows: per half tile (PART = 32 outputs, 2 registers a row) the block holds 8 rows' sums, the
  group's codes converted to float32 in registers as they are used, each conversion serving every row;
- more rows (16, and a prefill's 64 at a time): the group's codes converted once into a (G, 64) float32 block that
  stays in L1, then read by blocks of ROWS = 4 rows x a whole tile (4 x 4 registers).
The register blocks are written in LLVM IR (tile_sums.py: numba's loops spilled such blocks or left the code loop
rolled). Until session 15 they were a multiply and an add per code and row (Zen's add pipes took the adds beside the
multiplies on the FMA pipes); on Intel's cores the adds share the two FMA ports, so one FMA is a third fewer
instructions on them.

Measured (one thread, CPU time of every SmolLM2 product of a token, best of 5, load 6-6.7, this kernel against the
block-only one in one interleaved run, 2 rounds): 2 rows 8.6 / 10.0 -> 5.8 / 5.7 ms, 4 rows 12.0 / 13.4 -> 9.2 / 9.0,
8 rows 17.8 / 19.4 -> 15.7 / 15.9; 16 rows take the block path as before (29.2 / 32.1 -> 28.2 / 26.9, noise). The
block's conversion is a pass of its own, ~4.6 ms a token at any row count; converting in the register block costs
what that pass did at 16 rows (done for each 8, 30.5 -> 30.6-30.9 ms), since it shares the float pipes with the
multiplies and adds, and converting once for 8 rows while storing the codes for the next 8 measured slower (32-35).

Kept in numba's on-disk cache like weight_kernels.py's: a C function a weight family (rows_kernel(family)),
compiled when a model first multiplies rows by a matrix of that family (under the weights' compile lock), that rows()
(2 to SMALL_BATCH rows, a prefill's on one thread) and the spin pool's functions (a prefill's on two) call through
its address, not compiled again into each (numba links a callee into every caller: the njit row kernels and the spin
pool's copy took ~30 s and ~40 s of a first compile).
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types

from pagevis.kernel_intrinsics import call_address as _call
from pagevis.kernel_intrinsics import pointer_to

from pagevis.model.matrix_descriptor import (DESCRIPTOR, I8_DH, I8_DS, I8_QS, N_IN, NIB_DH, NIB_DS,
                                             NIB_MH, NIB_MS, NIB_QH, NIB_QS)
from pagevis.model.tile_sums import rows_switch, sums  # noqa: F401  (rows_switch: int8_kernels imports it from here)
from pagevis.model.weight_kernels import (HALF, Q4_0, SUPER, _group_sums, _i8_matvec_tiles, _nib_scales,
                                          _prefetch_ahead, _put, _put2, _scales, _u4_matvec_tiles, _u5_matvec_tiles)

TILE = 64
# up to FUSED_ROWS rows: the codes converted in the register block, which covers PART outputs of FUSED_ROWS rows
# (8 x 2 registers of sums); more rows: each group's codes converted once into a float32 block, then read by
# register blocks of a whole tile's outputs and ROWS rows (4 x 4 registers)
PART, FUSED_ROWS = 32, 8
ROWS = 4
KERNEL_ROWS = 64  # rows_kernel's rows a call of the tiles' kernel (quantized.PREFILL_ROWS)


# u4 (Q4_0, Q4_1, Q4_K), i8 groups of 32 (Q8_0, Q5_0) and of 16 (Q6_K): converting, and from a float32 block
_U4_FUSED, _I8_FUSED, _I8_16_FUSED = (sums(32, True, True, True, PART, FUSED_ROWS),
                                      sums(32, False, False, True, PART, FUSED_ROWS),
                                      sums(16, False, False, True, PART, FUSED_ROWS))
_U4_SUMS, _I8_SUMS, _I8_16_SUMS = (sums(32, True, True, False, TILE, ROWS), sums(32, False, False, False, TILE, ROWS),
                                   sums(16, False, False, False, TILE, ROWS))


@njit(cache=True, nogil=True, inline="always")
def _u4_codes(qs, t, g, c):
    """c (32, TILE): the group's codes as float32, in the matrix-vector kernel's order (j's low nibble, then its
    high one)."""
    for j in range(16):
        for r in range(TILE):
            q = np.int32(qs[t, g, j, r])
            c[2 * j, r] = np.float32(np.int32(q & 15))
            c[2 * j + 1, r] = np.float32(np.int32(q >> 4))


@njit(cache=True, nogil=True, inline="always")
def _i8_codes(qs, t, g, c):
    for j in range(qs.shape[2]):
        for r in range(TILE):
            c[j, r] = np.float32(qs[t, g, j, r])


@njit(cache=True, nogil=True, inline="always")
def _u4_rows_tiles(qs, dh, ds, mh, ms, per, mode, X, t0, t1, out):
    n, groups = X.shape[0], qs.shape[1]
    xs = np.empty((n, groups), np.float32)
    for i in range(n):
        _put(xs[i], 0, _group_sums(X[i], 32))
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    c, acc = np.empty((32, TILE), np.float32), np.empty((n, TILE), np.float32)
    stride, d_at, m_at, group_bytes = X.shape[1] * 4, d.ctypes.data, m.ctypes.data, qs.shape[2] * TILE
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            _prefetch_ahead(qs, t, g)
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            x_at, xs_at, acc_at = X.ctypes.data + g * 32 * 4, xs.ctypes.data + g * 4, acc.ctypes.data
            if n <= FUSED_ROWS:
                q_at = qs.ctypes.data + (t * groups + g) * group_bytes
                for o in range(0, TILE, PART):
                    _U4_FUSED(n, q_at + o, x_at, stride, d_at + o * 4, m_at + o * 4, xs_at, groups * 4, acc_at + o * 4)
            else:
                _u4_codes(qs, t, g, c)
                for i in range(0, n, ROWS):
                    _U4_SUMS(min(ROWS, n - i), c.ctypes.data, x_at + i * stride, stride, d_at, m_at,
                             xs_at + i * groups * 4, groups * 4, acc_at + i * TILE * 4)
        _put2(out, 0, (t - t0) * TILE, acc)


@njit(cache=True, nogil=True, inline="always")
def _i8_rows_tiles(qs, dh, ds, per, size, X, t0, t1, out):
    n, groups = X.shape[0], qs.shape[1]
    d, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    c, acc = np.empty((size, TILE), np.float32), np.empty((n, TILE), np.float32)
    stride, d_at = X.shape[1] * 4, d.ctypes.data
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            _prefetch_ahead(qs, t, g)
            _scales(dh, ds, per, t, g, d, sup)
            x_at, acc_at = X.ctypes.data + g * size * 4, acc.ctypes.data
            if n <= FUSED_ROWS:
                q_at = qs.ctypes.data + (t * groups + g) * size * TILE
                for o in range(0, TILE, PART):
                    if size == 32:
                        _I8_FUSED(n, q_at + o, x_at, stride, d_at + o * 4, d_at, d_at, 0, acc_at + o * 4)
                    else:
                        _I8_16_FUSED(n, q_at + o, x_at, stride, d_at + o * 4, d_at, d_at, 0, acc_at + o * 4)
                continue
            _i8_codes(qs, t, g, c)
            for i in range(0, n, ROWS):
                rows, at = min(ROWS, n - i), acc_at + i * TILE * 4
                if size == 32:
                    _I8_SUMS(rows, c.ctypes.data, x_at + i * stride, stride, d_at, d_at, d_at, 0, at)
                else:
                    _I8_16_SUMS(rows, c.ctypes.data, x_at + i * stride, stride, d_at, d_at, d_at, 0, at)
        _put2(out, 0, (t - t0) * TILE, acc)


_u8, _u32, _i16, _i8 = (pointer_to(t) for t in (types.uint8, types.uint32, types.int16, types.int8))
_f32, _i64 = pointer_to(types.float32), pointer_to(types.int64)


@njit(cache=True, nogil=True, inline="always")
def _shape3(words, at):
    return (words[at + 1], words[at + 2], words[at + 3])


@njit(cache=True, nogil=True, inline="always")
def _shape4(words, at):
    return (words[at + 1], words[at + 2], words[at + 3], words[at + 4])


@njit(cache=True, nogil=True, inline="always")
def _i8_arrays(words):
    """(qs, dh, ds) of the i8 matrix words describes (matrix_descriptor's layout): the one reading of its words,
    inlined into this module's kernel and the spin pool's row_kernel."""
    return (carray(_i8(words[I8_QS]), _shape4(words, I8_QS)), carray(_i16(words[I8_DH]), _shape3(words, I8_DH)),
            carray(_i8(words[I8_DS]), _shape3(words, I8_DS)))


@njit(cache=True, nogil=True, inline="always")
def _nib_arrays(words):
    """(qs, qh, dh, ds, mh, ms) of the u4 or u5 matrix words describes (matrix_descriptor's layout)."""
    return (carray(_u8(words[NIB_QS]), _shape4(words, NIB_QS)), carray(_u32(words[NIB_QH]), _shape3(words, NIB_QH)),
            carray(_i16(words[NIB_DH]), _shape3(words, NIB_DH)), carray(_i8(words[NIB_DS]), _shape3(words, NIB_DS)),
            carray(_i16(words[NIB_MH]), _shape3(words, NIB_MH)), carray(_i8(words[NIB_MS]), _shape3(words, NIB_MS)))


@njit(cache=True, nogil=True, inline="always")
def _block(words, x_address, i, n, t0, t1, target, stride):
    """Rows i.. (KERNEL_ROWS at most) of the n rows at x_address, and their outputs of tiles t0..t1 at target."""
    rows = min(KERNEL_ROWS, n - i)
    X = carray(_f32(x_address + 4 * i * words[N_IN]), (rows, words[N_IN]))
    at = target + 4 * (i * stride + t0 * TILE)  # tile t0's outputs of row i (stride may be below t1 * TILE)
    return X, carray(_f32(at), (rows, stride))[:, :(t1 - t0) * TILE]


@njit(cache=True, nogil=True, inline="always")
def _one_row(job, x_address, t0, t1, target):
    """The words of the matrix described at address job, the row at x_address and its outputs of tiles t0..t1 at
    target: what each matrix-vector kernel (_row_kernel) reads."""
    words = carray(_i64(job), (DESCRIPTOR,))
    return words, carray(_f32(x_address), (words[N_IN],)), carray(_f32(target + 4 * t0 * TILE), ((t1 - t0) * TILE,))


_SIGNATURE = types.void(*(types.int64,) * 7)


def _kernel(i8: bool, per: int, mode: int):
    """The rows kernel of one weight family (FAMILIES): a C function, tiles t0..t1 of the matrix described at address
    job times the n rows at x_address (n, in), into the rows of stride floats at target, each row bit for bit the
    matrix-vector kernel's. Compiled when a model first multiplies such a matrix by rows (rows_kernel), each family
    on its own (a closure: numba's cache keys it by its constants), so a model's first launch compiles the families
    its file holds (SmolLM2: two of five; the five in one C function took 23-30 s of a first compile here). rows() and
    the spin pool's functions call it through its address: numba links a callee into every caller."""
    if i8:
        @cfunc(_SIGNATURE, cache=True, error_model="numpy")
        def i8_rows(job, x_address, n, t0, t1, target, stride):
            words = carray(_i64(job), (DESCRIPTOR,))
            qs, dh, ds = _i8_arrays(words)
            for i in range(0, n, KERNEL_ROWS):
                X, out = _block(words, x_address, i, n, t0, t1, target, stride)
                _i8_rows_tiles(qs, dh, ds, per, mode, X, t0, t1, out)
        return i8_rows

    @cfunc(_SIGNATURE, cache=True, error_model="numpy")
    def u4_rows(job, x_address, n, t0, t1, target, stride):
        words = carray(_i64(job), (DESCRIPTOR,))
        qs, _, dh, ds, mh, ms = _nib_arrays(words)
        for i in range(0, n, KERNEL_ROWS):
            X, out = _block(words, x_address, i, n, t0, t1, target, stride)
            _u4_rows_tiles(qs, dh, ds, mh, ms, per, mode, X, t0, t1, out)
    return u4_rows


def _row_kernel(code: str, per: int, mode: int):
    """The matrix-vector kernel of one weight family (ROW_FAMILIES; code: its tiles' kernel, u4, u5 or i8), as
    _kernel's rows kernel: a C function of the same arguments (n and stride unused), the one row at x_address,
    weight_kernels' matrix-vector loops inlined with the family's constants. row() (one thread) and the spin pool (two)
    call it through its address; weight_kernels' nib_matvec held five families' copies in one function (5-7 s of a
    first compile here), and the spin pool's C function linked it again (~2 s)."""
    if code == "i8":
        @cfunc(_SIGNATURE, cache=True, error_model="numpy")
        def i8_row(job, x_address, n, t0, t1, target, stride):
            words, x, out = _one_row(job, x_address, t0, t1, target)
            qs, dh, ds = _i8_arrays(words)
            _i8_matvec_tiles(qs, dh, ds, per, mode, x, t0, t1, out)
        return i8_row
    if code == "u5":
        @cfunc(_SIGNATURE, cache=True, error_model="numpy")
        def u5_row(job, x_address, n, t0, t1, target, stride):
            words, x, out = _one_row(job, x_address, t0, t1, target)
            qs, qh, dh, ds, mh, ms = _nib_arrays(words)
            _u5_matvec_tiles(qs, qh, dh, ds, mh, ms, per, mode, x, _group_sums(x, 32), t0, t1, out)
        return u5_row

    @cfunc(_SIGNATURE, cache=True, error_model="numpy")
    def u4_row(job, x_address, n, t0, t1, target, stride):
        words, x, out = _one_row(job, x_address, t0, t1, target)
        qs, _, dh, ds, mh, ms = _nib_arrays(words)
        _u4_matvec_tiles(qs, dh, ds, mh, ms, per, mode, x, _group_sums(x, 32), t0, t1, out)
    return u4_row


# a family's kernels (matrix_descriptor.family names them): rows (i8, per, mode), mode being i8's group size; one row
# (tiles' kernel, per, mode)
FAMILIES = {"u4": (False, 1, HALF), "q4_0": (False, 1, Q4_0), "q4_k": (False, 8, SUPER),
            "i8": (True, 1, 32), "q6_k": (True, 16, 16)}
ROW_FAMILIES = {"u4": ("u4", 1, HALF), "q4_0": ("u4", 1, Q4_0), "q4_k": ("u4", 8, SUPER), "u5": ("u5", 1, HALF),
                "q5_k": ("u5", 8, SUPER), "i8": ("i8", 1, 32), "q6_k": ("i8", 16, 16)}
_COMPILED: dict[tuple[bool, str], int] = {}


def rows_kernel(family: str, one_row: bool = False) -> int:
    """The address of a family's rows kernel (_kernel), or with one_row its matrix-vector kernel (_row_kernel),
    compiled or loaded from numba's cache on first use (quantized.family_kernel asks through
    kernel_loader.import_kernels: under the compile lock)."""
    if (one_row, family) not in _COMPILED:
        kernel = _row_kernel(*ROW_FAMILIES[family]) if one_row else _kernel(*FAMILIES[family])
        _COMPILED[one_row, family] = int(kernel.address or 0)
    return _COMPILED[one_row, family]


@njit("void(int64, int64[::1], float32[:, ::1], int64, int64, float32[:, :])", cache=True, nogil=True)
def rows(kernel, job, X, t0, t1, out):
    """X times tiles t0..t1 of the matrix job describes (matrix_descriptor.describe()) into out (X's rows of those
    tiles' outputs, any row stride): rows_kernel, its address kernel."""
    _call(kernel, job.ctypes.data, X.ctypes.data, X.shape[0], t0, t1,  # type: ignore[call-arg]
          out.ctypes.data - 4 * t0 * TILE, out.strides[0] // 4)


@njit("void(int64, int64[::1], float32[::1], int64, int64, float32[::1])", cache=True, nogil=True)
def row(kernel, job, x, t0, t1, out):
    """x times tiles t0..t1 of the matrix job describes into out (those tiles' outputs): its family's
    matrix-vector kernel (_row_kernel), its address kernel."""
    _call(kernel, job.ctypes.data, x.ctypes.data, 1, t0, t1, out.ctypes.data - 4 * t0 * TILE,  # type: ignore[call-arg]
          0)



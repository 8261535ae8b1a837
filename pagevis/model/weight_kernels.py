"""Numba kernels that multiply activations by quantised weights in their packed form (see quantized.py).

Three packed formats cover every supported ggml type (quantized.py repacks each into one of them at load):
  u4: 4-bit codes q in 0..15, per 32-weight group a scale d and an offset m: w = d*q + m
      (Q4_0: m = -8d; Q4_1; Q4_K: d = super-scale * 6-bit scale, m = -super-min * 6-bit min)
  u5: u4's nibbles plus one high bit per weight (a uint32 per group): q in 0..31, w = d*q + m (Q5_1, Q5_K)
  i8: signed 8-bit codes, per G-weight group a scale: w = d*q (Q8_0 and Q5_0 (q = its 5 bits - 16), G = 32;
      Q6_K, G = 16, q = its 6 bits - 32, d = super-scale * 8-bit scale)
The scales are held as the file holds them: float16 bit patterns (as int16) and, for the K types, the 6- or 8-bit
sub-scales beside one float16 per super-block; the kernels convert a group's 64 rows of them to float32 (exactly:
see _half) as they use them, so every weight is the file's, in the file's bits.
Rows come in tiles of TILE = 64 output rows: `qs[tile, group, j, r]` is byte j of row r's group, so the innermost
loop runs across a tile's 64 rows, contiguous in memory, and LLVM vectorises it (a loop over one row's blocks
does not: ~4x slower). Per format three kernels:
  *_matvec(..., x, t0, t1, out): one row x, tiles t0..t1 into out (their rows) (decode); the group's codes times x
      summed first, then scaled:
      out[r] = sum_g d[g,r] * (sum_j q[g,j,r] x[j]) + m[g,r] * (sum_j x[j])
      u4 and i8: the tile's 64 group sums in 4 registers (tile_sums.sums, batch_kernels' generator: a batched row
      is the row alone bit for bit), each code converted as it is used and multiplied-and-added in one FMA, the
      codes asked for into L2 ahead of their use (_prefetch_l2_ahead); u5: numba's loop vectorised across rows
  nib_matmul(..., X, t0, t1, out): a few rows of u5 (a batched decode step; u4 and i8 take batch_kernels'): each
      group dequantised to float32 once, used by all rows, each row's group sum first (as *_matvec), vectorised
      across the tile's rows
  *_dequant(..., t0, t1, out): tiles t0..t1 as float32 (in_features, rows), for sgemm (prefill, big batches)
and the repack kernels that fill the packed arrays from the file's blocks at load.
All arithmetic is float32; every kernel is compiled once and kept in numba's on-disk cache (cache=True), with
explicit signatures: importing this module compiles (the first time) or loads the matrix-vector kernels (every later
time), the others (LAZY) when first used (compiled()).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import sigutils
from numba.core.typing import Signature

from pagevis.kernel_intrinsics import NjitOptions
from pagevis.kernel_intrinsics import bits_as_float32 as _bits_as_float32
from pagevis.kernel_intrinsics import prefetch as _prefetch
from pagevis.kernel_intrinsics import prefetch_l2 as _prefetch_l2
from pagevis.model.tile_sums import sums

TILE = 64
PREFETCH_AHEAD = 8192  # bytes: 4-8 groups of codes ahead (4096 and 8192 measured alike)
PREFETCH_L2_AHEAD = 16384  # bytes, the matrix-vector kernels' (8192-32768 measured alike on Emerald Rapids)
TWO_112 = np.float32(2.0 ** 112)

# The scales as the file holds them: float16 bit patterns (int16), converted in the kernels (_half) 64 rows at a time.
#   nib (u4, u5): qs, qh, dh, ds, mh, ms, high, per, mode
#     mode HALF: d = half(dh[t, g]), m = half(mh[t, g])                      (Q4_1, Q5_1)
#     mode Q4_0: d = half(dh[t, g]), m = -8 d                                (Q4_0)
#     mode SUPER: d = half(dh[t, g // per]) * ds[t, g], m = half(mh[t, g // per]) * ms[t, g]
#                 (Q4_K, Q5_K: per = 8 groups a super-block; mh holds -dmin; ds, ms the 6-bit scales and mins)
#   i8: qs, dh, ds, per: per 1: d = half(dh[t, g]) (Q8_0, Q5_0); else d = half(dh[t, g // per]) * ds[t, g] (Q6_K)
# Every product is exact in float32 (an 11-bit half times at most 8 bits), so the weights are those of the file.
HALF, Q4_0, SUPER = 0, 1, 2
_NIB_ARRAYS = ("uint8[:, :, :, ::1], uint32[:, :, ::1], int16[:, :, ::1], int8[:, :, ::1], int16[:, :, ::1], "
               "int8[:, :, ::1]")
_NIB = f"{_NIB_ARRAYS}, boolean, int64, int64"
_I8 = "int8[:, :, :, ::1], int16[:, :, ::1], int8[:, :, ::1], int64"
_MAT = "float32[:, ::1], int64, int64, float32[:, :]"
_DEQ = "int64, int64, float32[:, ::1]"
# the matrix-vector kernels' register blocks: one row, a whole tile's 64 sums (tile_sums.sums)
_U4_TILE = sums(32, True, True, True, TILE, 1)
_I8_TILE, _I8_16_TILE = sums(32, False, False, True, TILE, 1), sums(16, False, False, True, TILE, 1)


# One thread each (threads: weight_threads.py splits tiles between two callers); nogil so they run side by side.
_OPTIONS: NjitOptions = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy",
                            "boundscheck": False}
# The small-batch kernels may fuse a multiply and an add into one FMA (one rounding instead of two, so within the
# same bound): without it their arithmetic is a multiply and an add per weight and row
_BATCH_OPTIONS: NjitOptions = {**_OPTIONS, "fastmath": {"contract"}}


@njit("float32[::1](float32[::1], int64)", cache=True, nogil=True)
def _group_sums(x, group):
    sums = np.zeros(x.size // group, np.float32)
    for g in range(sums.size):
        s = np.float32(0)
        for j in range(group):
            s += x[g * group + j]
        sums[g] = s
    return sums


@njit(cache=True, nogil=True, inline="always")
def _half(h):
    """The finite float16 whose bits are the int16 h, as float32, exactly: sign-extended and shifted, its exponent
    and mantissa land in float32's (read so, a half's bits are 2**-112 of its value, subnormals included) and its
    sign in the sign bit once the three sign copies between them are cleared; then times 2**112. Three integer
    instructions and a multiply, so the loops over a tile's rows that use it vectorise. (Infinities and NaNs would
    come out finite: quantized.pack refuses scales that hold them.)"""
    # numba's stub types an intrinsic's call with its typing function's parameters (typingctx first)
    bits = (np.int32(h) << np.int32(13)) & np.int32(-0x70000001)
    return _bits_as_float32(bits) * TWO_112  # type: ignore[call-arg]


@njit(cache=True, nogil=True, inline="always")
def _scales(h, sub, per, t, g, out, sup):
    """out[r] = a group's scales for a tile's rows: half(h[t, g, r]), or (K types) half(h[t, g // per, r]) *
    sub[t, g, r], the super-block's halves converted into sup at its first group."""
    if per == 1:
        for r in range(TILE):
            out[r] = _half(h[t, g, r])
    else:
        if g % per == 0:
            for r in range(TILE):
                sup[r] = _half(h[t, g // per, r])
        for r in range(TILE):
            out[r] = sup[r] * np.float32(sub[t, g, r])


@njit(cache=True, nogil=True, inline="always")
def _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup):
    """d, m = a group's scales and offsets for a tile's rows (see the modes above); sup (2, TILE): scratch."""
    _scales(dh, ds, per, t, g, d, sup[0])
    if mode == Q4_0:
        for r in range(TILE):
            m[r] = d[r] * np.float32(-8)
    else:
        _scales(mh, ms, per, t, g, m, sup[1])


@njit("void(int16[::1], float32[::1])", cache=True, nogil=True)
def halves_to_float32(h, out):
    """The kernels' float16 conversion over a vector (its tests compare it with NumPy's on every half)."""
    for i in range(h.size):
        out[i] = _half(h[i])


@njit(cache=True, nogil=True, inline="always")
def _put(out, at, block):
    """out[at:at + block.size] = block, element by element: a slice assignment compiles numba's shape-mismatch error
    and its message's formatting into each kernel that has one (~1.5-2 s of a first compile each here)."""
    for r in range(block.size):
        out[at + r] = block[r]


@njit(cache=True, nogil=True, inline="always")
def _put2(out, row0, col0, block):
    """out[row0:row0 + rows, col0:col0 + cols] = block (rows, cols), as _put."""
    for i in range(block.shape[0]):
        for r in range(block.shape[1]):
            out[row0 + i, col0 + r] = block[i, r]


@njit(cache=True, nogil=True, inline="always")
def _prefetch_ahead(qs, t, g):
    """The codes PREFETCH_AHEAD bytes past group g of tile t, asked for: the row-by-row dot products read a group's
    codes 64 bytes apart (one line per j), which the hardware prefetcher does not follow from memory (measured:
    12 against 18 GB/s over Gemma 3's 178 MB logits matrix without it; the same with it, in cache)."""
    group_bytes = qs.shape[2] * TILE
    at = qs.ctypes.data + (t * qs.shape[1] + g) * group_bytes + PREFETCH_AHEAD
    for k in range(0, group_bytes, 64):
        _prefetch(at + k)


@njit(cache=True, nogil=True, inline="always")
def _prefetch_l2_ahead(q_at, group_bytes):
    """The lines PREFETCH_L2_AHEAD bytes past a group's codes (at address q_at) asked for into the second-level cache
    (kernel_intrinsics.prefetch_l2): the matrix-vector kernels stream their matrix from memory once a product."""
    for k in range(0, group_bytes, 64):
        _prefetch_l2(q_at + PREFETCH_L2_AHEAD + k)


@njit(cache=True, nogil=True, inline="always")
def _u5_dot(qs, qh, t, g, x, s):
    """s[r] = sum over the group's 32 weights of code * x, for a tile's rows r (5-bit codes: a nibble and its fifth
    bit from qh, bit j: weight j), in j's order. Row by row with j's loop (a literal 16) unrolled: LLVM vectorises
    across rows with each sum in a register."""
    b = g * 32
    for r in range(TILE):
        v, h = np.float32(0), np.int32(qh[t, g, r])
        for j in range(16):
            q = np.int32(qs[t, g, j, r])
            lo = np.int32((q & 15) | (((h >> j) & 1) << 4))
            hi = np.int32((q >> 4) | (((h >> (j + 16)) & 1) << 4))
            v = v + np.float32(lo) * x[b + j] + np.float32(hi) * x[b + 16 + j]
        s[r] = v


@njit(cache=True, nogil=True, inline="always")
def _nib_weights(qs, qh, high, t, g, d, m, w):
    """w (32, TILE) = the group's weights d * code + m, as float32 (one pass: a pass per step was slower)."""
    if high:
        for j in range(16):
            for r in range(TILE):
                q, h = np.int32(qs[t, g, j, r]), np.int32(qh[t, g, r])
                lo = np.int32((q & 15) | (((h >> j) & 1) << 4))
                hi = np.int32((q >> 4) | (((h >> (j + 16)) & 1) << 4))
                w[j, r] = d[r] * np.float32(lo) + m[r]
                w[j + 16, r] = d[r] * np.float32(hi) + m[r]
    else:
        for j in range(16):
            for r in range(TILE):
                q = np.int32(qs[t, g, j, r])
                w[j, r] = d[r] * np.float32(np.int32(q & 15)) + m[r]
                w[j + 16, r] = d[r] * np.float32(np.int32(q >> 4)) + m[r]


@njit(cache=True, nogil=True, inline="always")
def _nib_scale_sums(dh, ds, mh, ms, per, mode, t, g, s, xsg, acc, sup):
    """acc[r] += d[r] * s[r] + m[r] * xsg with the group's scales converted in the same loop (one pass: converting
    into a buffer first made SmolLM2's matrix-vector products ~15% slower); a K type's super-block scales (sup:
    d, then -dmin) once per super-block."""
    if per > 1:
        if g % per == 0:
            for r in range(TILE):
                sup[0, r] = _half(dh[t, g // per, r])
                sup[1, r] = _half(mh[t, g // per, r])
        for r in range(TILE):
            acc[r] += (sup[0, r] * np.float32(ds[t, g, r])) * s[r] + (sup[1, r] * np.float32(ms[t, g, r])) * xsg
    elif mode == Q4_0:
        for r in range(TILE):
            d = _half(dh[t, g, r])
            acc[r] += d * s[r] + (d * np.float32(-8)) * xsg
    else:
        for r in range(TILE):
            acc[r] += _half(dh[t, g, r]) * s[r] + _half(mh[t, g, r]) * xsg


@njit(cache=True, nogil=True, inline="always")
def _u5_matvec_tiles(qs, qh, dh, ds, mh, ms, per, mode, x, xs, t0, t1, out):
    sup, s = np.empty((2, TILE), np.float32), np.empty(TILE, np.float32)
    for t in range(t0, t1):
        acc = np.zeros(TILE, np.float32)
        for g in range(qs.shape[1]):
            _prefetch_ahead(qs, t, g)
            _u5_dot(qs, qh, t, g, x, s)
            _nib_scale_sums(dh, ds, mh, ms, per, mode, t, g, s, xs[g], acc, sup)
        _put(out, (t - t0) * TILE, acc)


@njit(cache=True, nogil=True, inline="always")
def _u4_matvec_tiles(qs, dh, ds, mh, ms, per, mode, x, xs, t0, t1, out):
    """Per tile and group: the scales converted (_nib_scales), then the register block of tile_sums (the tile's 64
    sums in 4 registers, a code's conversion and one FMA per weight) adds d * s + m * xsum into acc."""
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    acc = np.empty(TILE, np.float32)
    groups, group_bytes = qs.shape[1], qs.shape[2] * TILE
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            q_at = qs.ctypes.data + (t * groups + g) * group_bytes
            _prefetch_l2_ahead(q_at, group_bytes)
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            _U4_TILE(1, q_at, x.ctypes.data + g * 128, 0, d.ctypes.data, m.ctypes.data, xs.ctypes.data + g * 4, 0,
                     acc.ctypes.data)
        _put(out, (t - t0) * TILE, acc)


@njit(**_OPTIONS)
def nib_matvec(qs, qh, dh, ds, mh, ms, high, per, mode, x, t0, t1, out):
    """One copy of the loops per type family, its flags literal: with them tested inside the group loop, SmolLM2's
    Q4_1 products ran ~25% slower."""
    xs = _group_sums(x, 32)
    if per > 1:  # Q4_K, Q5_K: 8 groups a super-block
        if high:
            _u5_matvec_tiles(qs, qh, dh, ds, mh, ms, 8, SUPER, x, xs, t0, t1, out)
        else:
            _u4_matvec_tiles(qs, dh, ds, mh, ms, 8, SUPER, x, xs, t0, t1, out)
    elif high:  # Q5_1
        _u5_matvec_tiles(qs, qh, dh, ds, mh, ms, 1, HALF, x, xs, t0, t1, out)
    elif mode == Q4_0:
        _u4_matvec_tiles(qs, dh, ds, mh, ms, 1, Q4_0, x, xs, t0, t1, out)
    else:  # Q4_1
        _u4_matvec_tiles(qs, dh, ds, mh, ms, 1, HALF, x, xs, t0, t1, out)


@njit(cache=True, nogil=True, inline="always")
def _i8_matvec_tiles(qs, dh, ds, per, size, x, t0, t1, out):
    """As _u4_matvec_tiles for signed 8-bit codes, size (a literal: 32, or Q6_K's 16) weights a group."""
    d, sup, acc = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    groups, group_bytes = qs.shape[1], size * TILE
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            q_at = qs.ctypes.data + (t * groups + g) * group_bytes
            _prefetch_l2_ahead(q_at, group_bytes)
            _scales(dh, ds, per, t, g, d, sup)
            x_at = x.ctypes.data + g * size * 4
            if size == 32:
                _I8_TILE(1, q_at, x_at, 0, d.ctypes.data, d.ctypes.data, d.ctypes.data, 0, acc.ctypes.data)
            else:
                _I8_16_TILE(1, q_at, x_at, 0, d.ctypes.data, d.ctypes.data, d.ctypes.data, 0, acc.ctypes.data)
        _put(out, (t - t0) * TILE, acc)


@njit(**_OPTIONS)
def i8_matvec(qs, dh, ds, per, x, t0, t1, out):
    if per > 1:  # Q6_K: 16 groups of 16 a super-block
        _i8_matvec_tiles(qs, dh, ds, 16, 16, x, t0, t1, out)
    else:  # Q8_0, Q5_0
        _i8_matvec_tiles(qs, dh, ds, 1, 32, x, t0, t1, out)


@njit(cache=True, nogil=True, inline="always")
def _accumulate32(w, X, column, acc):
    """acc[i, r] += sum_j w[j, r] * X[i, column + j] for one dequantised 32-weight group w (32, TILE): per row the
    group's sum first, as the matrix-vector kernel. The j loop has a literal trip count, so LLVM unrolls it and
    vectorises across r with the sum in a register (a j-then-r loop kept acc in memory: 1.6-1.8x slower)."""
    for i in range(X.shape[0]):
        for r in range(TILE):
            s = np.float32(0)
            for j in range(32):
                s += w[j, r] * X[i, column + j]
            acc[i, r] += s


@njit(cache=True, nogil=True, inline="always")
def _nib_matmul_tiles(qs, qh, dh, ds, mh, ms, high, per, mode, X, t0, t1, out):
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    for t in range(t0, t1):
        acc = np.zeros((X.shape[0], TILE), np.float32)
        w = np.empty((32, TILE), np.float32)
        for g in range(qs.shape[1]):
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            _nib_weights(qs, qh, high, t, g, d, m, w)
            _accumulate32(w, X, g * 32, acc)
        _put2(out, 0, (t - t0) * TILE, acc)


@njit(**_BATCH_OPTIONS)
def nib_matmul(qs, qh, dh, ds, mh, ms, high, per, mode, X, t0, t1, out):
    """u5 only (Q5_1, Q5_K: u4 and i8 rows take batch_kernels' kernel; their copies here cost ~7 s of a first compile
    and were never called); per type a copy with its flags literal, as nib_matvec (tested inside the loops: 1.2-1.5x
    slower)."""
    if per > 1:
        _nib_matmul_tiles(qs, qh, dh, ds, mh, ms, True, 8, SUPER, X, t0, t1, out)
    else:
        _nib_matmul_tiles(qs, qh, dh, ds, mh, ms, True, 1, HALF, X, t0, t1, out)


@njit(cache=True, nogil=True, inline="always")
def _i8_weights(qs, t, g, d, w):
    for j in range(qs.shape[2]):
        for r in range(TILE):
            w[j, r] = d[r] * np.float32(qs[t, g, j, r])


@njit(cache=True, nogil=True, inline="always")
def _nib_dequant_tiles(qs, qh, dh, ds, mh, ms, high, per, mode, t0, t1, out):
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    w = np.empty((32, TILE), np.float32)
    for t in range(t0, t1):
        for g in range(qs.shape[1]):
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            _nib_weights(qs, qh, high, t, g, d, m, w)
            _put2(out, g * 32, (t - t0) * TILE, w)


@njit(**_OPTIONS)
def nib_dequant(qs, qh, dh, ds, mh, ms, high, per, mode, t0, t1, out):
    """One copy for every type (dequantising is a small part of the sgemm it feeds: compiled once, not per type)."""
    _nib_dequant_tiles(qs, qh, dh, ds, mh, ms, high, per, mode, t0, t1, out)


@njit(cache=True, nogil=True, inline="always")
def _i8_dequant_tiles(qs, dh, ds, per, t0, t1, out):
    groups, size = qs.shape[1], qs.shape[2]
    d, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    w = np.empty((size, TILE), np.float32)
    for t in range(t0, t1):
        for g in range(groups):
            _scales(dh, ds, per, t, g, d, sup)
            _i8_weights(qs, t, g, d, w)
            _put2(out, g * size, (t - t0) * TILE, w)


@njit(**_OPTIONS)
def i8_dequant(qs, dh, ds, per, t0, t1, out):
    _i8_dequant_tiles(qs, dh, ds, per, t0, t1, out)


# Repacking (quantized.pack): raw GGUF rows (n, bytes a row) -> rows row0.. of the packed arrays, block by block,
# reading ggml's layouts as gguf-py's dequantiser does (the tests check every type against it).
# the file's rows: a read-only mapping (numba's signature strings cannot say readonly)
_SRC = types.Array(types.uint8, 2, "C", readonly=True)


def _signature(*arguments) -> Signature:
    """A repack kernel's signature (it returns whether a scale was infinite or NaN) from numba types and signature
    strings' argument lists."""
    parsed = []
    for argument in arguments:
        parsed += [argument] if isinstance(argument, types.Type) else list(sigutils.normalize_signature(
            f"void({argument})")[0])
    return types.boolean(*parsed)


@njit(cache=True, nogil=True, inline="always")
def _u16(src, i, at):
    """A little-endian 16-bit field (a float16's bits), as int16."""
    return np.int16(np.int32(src[i, at]) | (np.int32(src[i, at + 1]) << np.int32(8)))


@njit(cache=True, nogil=True, inline="always")
def _inf_nan(h):
    """Whether the float16 bits h are an infinity or a NaN (its exponent all ones)."""
    return (np.int32(h) & np.int32(0x7C00)) == np.int32(0x7C00)


@njit(cache=True, nogil=True, inline="always")
def _u32(src, i, at):
    return np.uint32(np.uint32(src[i, at]) | (np.uint32(src[i, at + 1]) << np.uint32(8))
                     | (np.uint32(src[i, at + 2]) << np.uint32(16)) | (np.uint32(src[i, at + 3]) << np.uint32(24)))


@njit(**_OPTIONS)
def repack_nib(src, row0, qs, qh, dh, ds, mh, ms, block_bytes, has_m, has_h):
    """Q4_0 {d, qs[16]}, Q4_1 {d, m, qs[16]}, Q5_1 {d, m, qh[4], qs[16]}: the file's bytes are the packed ones (low
    nibble weight j, high nibble j + 16; qh bit j weight j), moved into tiles."""
    bad = False
    for i in range(src.shape[0]):
        t, r = (row0 + i) // TILE, (row0 + i) % TILE
        for b in range(src.shape[1] // block_bytes):
            at = b * block_bytes
            dh[t, b, r] = _u16(src, i, at)
            bad |= _inf_nan(dh[t, b, r])
            at += 2
            if has_m:
                mh[t, b, r] = _u16(src, i, at)
                bad |= _inf_nan(mh[t, b, r])
                at += 2
            if has_h:
                qh[t, b, r] = _u32(src, i, at)
                at += 4
            for j in range(16):
                qs[t, b, j, r] = src[i, at + j]
    return bad


@njit(**_OPTIONS)
def repack_k(src, row0, qs, qh, dh, ds, mh, ms, five):
    """Q4_K {d, dmin, scales[12], qs[128]}, Q5_K {d, dmin, scales[12], qh[32], qs[128]}: 8 groups of 32 a block,
    6-bit scales and mins (gguf-py's get_scale_min), mh = -dmin; qs bytes 32c..32c+31 hold weights 64c.. in their
    low nibbles and 64c+32.. in their high ones (regrouped into u4's group order); Q5_K's high bit of weight
    32k + j is bit k of qh[j]."""
    block_bytes = 176 if five else 144
    bad = False
    for i in range(src.shape[0]):
        t, r = (row0 + i) // TILE, (row0 + i) % TILE
        for b in range(src.shape[1] // block_bytes):
            at = b * block_bytes
            dh[t, b, r] = _u16(src, i, at)
            mh[t, b, r] = _u16(src, i, at + 2) ^ np.int16(-0x8000)
            bad |= _inf_nan(dh[t, b, r]) | _inf_nan(mh[t, b, r])
            sc = at + 4
            for k in range(8):
                if k < 4:
                    scale, low = src[i, sc + k] & 63, src[i, sc + k + 4] & 63
                else:
                    scale = (src[i, sc + k + 4] & 15) | ((src[i, sc + k - 4] >> 6) << 4)
                    low = (src[i, sc + k + 4] >> 4) | ((src[i, sc + k] >> 6) << 4)
                ds[t, 8 * b + k, r] = np.int8(scale)
                ms[t, 8 * b + k, r] = np.int8(low)
            q = at + (48 if five else 16)
            for c in range(4):
                for j in range(16):
                    f0, f1 = src[i, q + 32 * c + j], src[i, q + 32 * c + 16 + j]
                    qs[t, 8 * b + 2 * c, j, r] = (f0 & 15) | ((f1 & 15) << 4)
                    qs[t, 8 * b + 2 * c + 1, j, r] = (f0 >> 4) | (f1 & 0xF0)
            if five:
                for k in range(8):
                    h = np.uint32(0)
                    for j in range(32):
                        h |= np.uint32((src[i, at + 16 + j] >> k) & 1) << np.uint32(j)
                    qh[t, 8 * b + k, r] = h
    return bad


@njit(cache=True, nogil=True, inline="always")
def _signed(byte):
    v = np.int32(byte)
    return np.int8(v - ((v >> 7) << 8))


@njit(**_OPTIONS)
def repack_i8(src, row0, qs, dh, ds, per, kind):
    """kind 8: Q8_0 {d, qs[32] int8}; 5: Q5_0 {d, qh[4], qs[16]}, codes (nibble | high bit << 4) - 16;
    6: Q6_K {ql[128], qh[64], scales[16] int8, d}: 16 groups of 16, code = ql's nibble | qh's 2 bits << 4, - 32."""
    block_bytes = 34 if kind == 8 else (22 if kind == 5 else 210)
    bad = False
    for i in range(src.shape[0]):
        t, r = (row0 + i) // TILE, (row0 + i) % TILE
        for b in range(src.shape[1] // block_bytes):
            at = b * block_bytes
            if kind == 8:
                dh[t, b, r] = _u16(src, i, at)
                for j in range(32):
                    qs[t, b, j, r] = _signed(src[i, at + 2 + j])
            elif kind == 5:
                dh[t, b, r] = _u16(src, i, at)
                h = _u32(src, i, at + 2)
                for j in range(16):
                    byte = np.int32(src[i, at + 6 + j])
                    qs[t, b, j, r] = np.int8((byte & 15) + ((np.int32(h >> np.uint32(j)) & 1) << 4) - 16)
                    qs[t, b, j + 16, r] = np.int8((byte >> 4) + ((np.int32(h >> np.uint32(j + 16)) & 1) << 4) - 16)
            else:
                dh[t, b, r] = _u16(src, i, at + 208)
                for k in range(16):
                    ds[t, 16 * b + k, r] = _signed(src[i, at + 192 + k])
                for w in range(256):
                    group, j = w // 32, w % 32  # weight w: ql byte and shift, qh byte and shift
                    half, quarter = group // 4, group % 4
                    low = (np.int32(src[i, at + 64 * half + (quarter % 2) * 32 + j]) >> (4 * (quarter // 2))) & 15
                    high = (np.int32(src[i, at + 128 + 32 * half + j]) >> (2 * quarter)) & 3
                    qs[t, 16 * b + w // 16, w % 16, r] = np.int8((low | (high << 4)) - 32)
            bad |= _inf_nan(dh[t, b, r])
    return bad


# The matrix-vector kernels with their families' flags as arguments, for the tests (compiled when first called):
# the app's are batch_kernels' C functions a family (_row_kernel), the same loops inlined with the flags as constants
KERNELS = {"u4": nib_matvec, "u5": nib_matvec, "i8": i8_matvec}  # u4: high False (a placeholder for qh)
# The kernels compiled on demand (compiled(name), through quantized.weight_kernel: under the compile lock), not when
# the module is imported: a model's file needs some of them (SmolLM2's pagevis run: repack_nib, repack_i8 and
# i8_dequant, for its Q4_1 and Q8_0 matrices and its embedding's rows; nib_matmul alone took ~5 s of a first compile)
LAZY = {
    "nib_matmul": f"void({_NIB}, {_MAT})",  # u5's rows (u4 and i8 rows: batch_kernels')
    "nib_dequant": f"void({_NIB}, {_DEQ})", "i8_dequant": f"void({_I8}, {_DEQ})",
    "repack_nib": _signature(_SRC, f"int64, {_NIB_ARRAYS}, int64, boolean, boolean"),
    "repack_k": _signature(_SRC, f"int64, {_NIB_ARRAYS}, boolean"),
    "repack_i8": _signature(_SRC, f"int64, {_I8}, int64"),
}


def compiled(name: str):
    """The kernel `name` of LAZY compiled (or loaded from numba's cache) for its signature, and compiled no more: a
    call with other argument types converts them as to an explicit signature's."""
    kernel = globals()[name]
    kernel.compile(LAZY[name])
    kernel.disable_compile()
    return kernel

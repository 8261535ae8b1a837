"""Several rows times the packed weights: the kernels of a batched decode step (2 to quantized.SMALL_BATCH rows).

A weight read once serves every row, and each row's result is bit for bit the matrix-vector kernel's for that row
alone (weight_kernels.py), so a batched decode is the same arithmetic as decoding each sequence by itself. Per tile
of 64 output rows and group of G weights (32; Q6_K 16) the group's codes are converted to float32 once into a
(G, 64) block that stays in L1 (the 4-bit codes in the matrix-vector kernel's order: weight j, then j + 16); then,
ROWS batch rows at a time, a register block of ROWS x 64 sums (16 zmm registers at 4 rows) takes the group's sums
straight from the block, and each row's sum is scaled into its output as the matrix-vector kernel scales it:
    out[i, r] += d[g, r] * (sum_j q[g, j, r] x[i, j]) + m[g, r] * (sum_j x[i, j])
every multiply and add in the matrix-vector kernel's order, none fused (an FMA rounds once where it rounds twice).
The register block is written in LLVM IR (`_sums`: numba's loops spilled such blocks or left the code loop rolled),
a multiply and an add per code and row: Zen's add pipes take the adds beside the multiplies on the FMA pipes, so
this runs at the FMA rate.

Measured (one thread, Zen 5, CPU time of every SmolLM2 product of a token, best of 3, load 5.8, one interleaved run;
docs/speed.md, batches): 8 rows 26.5 -> 16.7 ms (the previous kernel: two rows per code load, sums in numba loops
with FMA), 16 rows 43.3 -> 28.7 ms (75 GMAC/s), 2 rows 8.0 -> 7.7 ms; one row through the matrix-vector kernel 4.9.
Each extra row costs ~1.4 ms (~95 GMAC/s); the rest (~5 ms) is converting the codes and reading the weights.

Compiled on first use (under weight_kernels' compile lock) and kept in numba's on-disk cache like weight_kernels.py's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from pagevis.model.weight_kernels import (_I8, _MAT, _NIB, _OPTIONS, HALF, Q4_0, SUPER, _group_sums, _nib_scales,
                                         _prefetch_ahead, _scales)

TILE = 64
LANES = 16  # float32 lanes of a 512-bit register: a tile's 64 outputs are 4 registers a row
ROWS = 4  # batch rows a register block (4 x 4 registers of sums); 5 and 6 measured slower or alike


def _sums(size: int, pairs: bool, offsets: bool):
    """An intrinsic: for batch rows i < rows (1 to ROWS, read at run time) and a tile's 64 outputs r,
        acc[i, r] = acc[i, r] + (d[r] * s[i, r] + m[r] * xsum[i])     (offsets; else acc[i, r] + d[r] * s[i, r])
        s[i, r] = (((0 + c[0, r] x[i, k(0)]) + c[1, r] x[i, k(1)]) + ...)  over the group's `size` codes
    where k(j) = j // 2 + 16 (j % 2) for 4-bit codes (pairs: the matrix-vector kernel's low then high nibble) and
    j otherwise. Arguments are addresses (int64) and byte strides: c (size, 64) float32 codes; x, row 0's first
    input of the group (row i at x + i * x_stride); d, m (64) float32; xsum, row 0's group sum (stride
    xsum_stride); acc (rows, 64) float32, contiguous. Straight-line code for each row count, chosen by a switch."""
    order = [j // 2 + 16 * (j % 2) for j in range(size)] if pairs else list(range(size))
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec = ir.VectorType(f32, LANES)

    def block(builder, rows, c, x, x_stride, d, m, xsum, xsum_stride, acc):
        def address(base, offset):
            return builder.add(base, offset if isinstance(offset, ir.Value) else ir.Constant(i64, offset))

        def load_vector(base, offset):
            return builder.load(builder.inttoptr(address(base, offset), vec.as_pointer()), align=4)

        def broadcast(base, offset):
            scalar = builder.load(builder.inttoptr(address(base, offset), f32.as_pointer()), align=4)
            one = builder.insert_element(ir.Constant(vec, None), scalar, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vec, None), ir.Constant(ir.VectorType(i32, LANES),
                                                                                  [0] * LANES))

        x_rows = [address(x, builder.mul(x_stride, ir.Constant(i64, i))) for i in range(rows)]
        sums = [[ir.Constant(vec, [0.0] * LANES) for _ in range(TILE // LANES)] for _ in range(rows)]
        for j, k in enumerate(order):
            codes = [load_vector(c, (j * TILE + v * LANES) * 4) for v in range(TILE // LANES)]
            for i in range(rows):
                xv = broadcast(x_rows[i], k * 4)
                for v, code in enumerate(codes):
                    sums[i][v] = builder.fadd(sums[i][v], builder.fmul(code, xv))
        for i in range(rows):
            xs = broadcast(address(xsum, builder.mul(xsum_stride, ir.Constant(i64, i))), 0) if offsets else None
            for v in range(TILE // LANES):
                term = builder.fmul(load_vector(d, v * LANES * 4), sums[i][v])
                if offsets:
                    term = builder.fadd(term, builder.fmul(load_vector(m, v * LANES * 4), xs))
                target = builder.inttoptr(address(acc, (i * TILE + v * LANES) * 4), vec.as_pointer())
                builder.store(builder.fadd(builder.load(target, align=4), term), target, align=4)

    def codegen(context, builder, signature, args):
        done = builder.append_basic_block("done")
        cases = [builder.append_basic_block(f"rows{rows}") for rows in range(1, ROWS + 1)]
        switch = builder.switch(args[0], cases[0])
        for rows, case in enumerate(cases, 1):
            switch.add_case(ir.Constant(i64, rows), case)
            with builder.goto_block(case):
                block(builder, rows, *args[1:])
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    def typer(typingctx, rows, c, x, x_stride, d, m, xsum, xsum_stride, acc):
        return types.void(*([types.int64] * 9)), codegen

    return intrinsic(typer)


# u4 (Q4_0, Q4_1, Q4_K), i8 groups of 32 (Q8_0, Q5_0) and of 16 (Q6_K)
_U4_SUMS, _I8_SUMS, _I8_16_SUMS = _sums(32, True, True), _sums(32, False, False), _sums(16, False, False)


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
        xs[i] = _group_sums(X[i], 32)
    d, m, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty((2, TILE), np.float32)
    c, acc = np.empty((32, TILE), np.float32), np.empty((n, TILE), np.float32)
    stride, c_at, d_at, m_at = X.shape[1] * 4, c.ctypes.data, d.ctypes.data, m.ctypes.data
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            _prefetch_ahead(qs, t, g)
            _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
            _u4_codes(qs, t, g, c)
            for i in range(0, n, ROWS):
                _U4_SUMS(min(ROWS, n - i), c_at, X.ctypes.data + (i * X.shape[1] + g * 32) * 4, stride, d_at, m_at,
                          xs.ctypes.data + (i * groups + g) * 4, groups * 4, acc.ctypes.data + i * TILE * 4)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


@njit(cache=True, nogil=True, inline="always")
def _i8_rows_tiles(qs, dh, ds, per, size, X, t0, t1, out):
    n = X.shape[0]
    d, sup = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    c, acc = np.empty((size, TILE), np.float32), np.empty((n, TILE), np.float32)
    stride, c_at, d_at = X.shape[1] * 4, c.ctypes.data, d.ctypes.data
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(qs.shape[1]):
            _prefetch_ahead(qs, t, g)
            _scales(dh, ds, per, t, g, d, sup)
            _i8_codes(qs, t, g, c)
            for i in range(0, n, ROWS):
                rows, acc_at = min(ROWS, n - i), acc.ctypes.data + i * TILE * 4
                x_at = X.ctypes.data + (i * X.shape[1] + g * size) * 4
                if size == 32:
                    _I8_SUMS(rows, c_at, x_at, stride, d_at, d_at, d_at, 0, acc_at)
                else:
                    _I8_16_SUMS(rows, c_at, x_at, stride, d_at, d_at, d_at, 0, acc_at)
        out[:, (t - t0) * TILE:(t - t0 + 1) * TILE] = acc


def _u4_rows(qs, qh, dh, ds, mh, ms, high, per, mode, X, t0, t1, out):
    """One copy per type with its flags literal, as weight_kernels' kernels."""
    if per > 1:  # Q4_K
        _u4_rows_tiles(qs, dh, ds, mh, ms, 8, SUPER, X, t0, t1, out)
    elif mode == Q4_0:
        _u4_rows_tiles(qs, dh, ds, mh, ms, 1, Q4_0, X, t0, t1, out)
    else:  # Q4_1
        _u4_rows_tiles(qs, dh, ds, mh, ms, 1, HALF, X, t0, t1, out)


def _i8_rows(qs, dh, ds, per, X, t0, t1, out):
    if per > 1:  # Q6_K: groups of 16, 16 a super-block
        _i8_rows_tiles(qs, dh, ds, 16, 16, X, t0, t1, out)
    else:  # Q8_0, Q5_0
        _i8_rows_tiles(qs, dh, ds, 1, 32, X, t0, t1, out)


def compiled() -> dict:
    """The row kernels by packed format, for quantized.QuantMatrix.product's 2 to SMALL_BATCH rows (it calls this
    once, through kernel_loader.import_kernels: under the compile lock, a damaged cache healed, in memory where numba
    cannot cache): compiled, or loaded from numba's on-disk cache. u4 (Q4_0, Q4_1, Q4_K) and i8 (Q8_0, Q5_0, Q6_K):
    the types SmolLM2's and Gemma 3's files hold; u5 (Q5_1, Q5_K) keeps weight_kernels' small-batch kernel."""
    return {"u4": njit(f"void({_NIB}, {_MAT})", **_OPTIONS)(_u4_rows),
            "i8": njit(f"void({_I8}, {_MAT})", **_OPTIONS)(_i8_rows)}

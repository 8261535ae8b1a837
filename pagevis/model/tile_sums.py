"""The register blocks of the packed-weight kernels, written in LLVM IR: a group's codes times a few input rows, summed
per output across a tile's rows, for weight_kernels.py's matrix-vector kernel (one row, a whole tile of 64 outputs:
4 zmm sums) and batch_kernels.py's (up to 8 rows over half a tile, or 4 rows over a whole one). One generator for
both, so a batched row is the row alone bit for bit. numba's loops left such blocks rolled or spilled them, and
vectorised the matrix-vector kernel's loop one 16-output register at a time, its 32 adds a chain of latency.

Each code times its input is one FMA (llvm.fma, fused whatever the compiler's flags: the same bits everywhere), summed
in the group's order: a code is an exact small integer in float32, so each step rounds once (a multiply and an add
rounded twice; the products' bounds, tests/test_weight_kernels.py, hold either way). Then per output
    acc = acc + (d * s + m * xsum)      (offsets: u4's; else acc + d * s)
a multiply and an add each, as before.

Only intrinsics here (nothing compiled of its own): they are inlined into the kernel modules that use them, and
numba's on-disk cache does not notice a change here, so change this only together with those modules' files (or
clear the cache). Built on nothing of pagevis.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

TILE = 64
LANES = 16  # float32 lanes of a 512-bit register


def sums(size: int, pairs: bool, offsets: bool, fused: bool, width: int, most: int):
    """An intrinsic: for input rows i < rows (1 to `most`, read at run time) and `width` outputs r (a multiple of
    LANES) of a tile,
        acc[i, r] = acc[i, r] + (d[r] * s[i, r] + m[r] * xsum[i])     (offsets; else acc[i, r] + d[r] * s[i, r])
        s[i, r] = fma(c[size-1, r], x[i, k(size-1)], ... fma(c[1, r], x[i, k(1)], fma(c[0, r], x[i, k(0)], 0)))
    where k(j) = j // 2 + 16 (j % 2) for 4-bit codes (pairs: c[j] is byte j // 2's low nibble for even j, its high
    nibble for odd j) and j otherwise (c[j] is byte j, signed); each code converted to float32 in a register as it
    is used (fused: one conversion serves every row) or read from a float32 block (size, TILE) of the group's codes.
    Arguments are addresses (int64) and byte strides: q, the first code byte (fused: a group's line of 64 bytes per
    byte row) or the float32 block; x, row 0's first input of the group (row i at x + i * x_stride); d, m (width)
    float32; xsum, row 0's group sum (stride xsum_stride); acc, row 0's first sum (row i at acc + i * TILE * 4).
    Straight-line code for each row count, chosen by a switch."""
    order = [j // 2 + 16 * (j % 2) for j in range(size)] if pairs else list(range(size))
    f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vec, ints, bytes_ = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), ir.VectorType(i8, LANES)
    vectors = width // LANES

    def block(builder, rows, q, x, x_stride, d, m, xsum, xsum_stride, acc):
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]), "llvm.fma.v16f32")

        def address(base, offset):
            return builder.add(base, offset if isinstance(offset, ir.Value) else ir.Constant(i64, offset))

        def load_vector(base, offset):
            return builder.load(builder.inttoptr(address(base, offset), vec.as_pointer()), align=4)

        def broadcast(base, offset):
            scalar = builder.load(builder.inttoptr(address(base, offset), f32.as_pointer()), align=4)
            one = builder.insert_element(ir.Constant(vec, None), scalar, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vec, None), ir.Constant(ints, [0] * LANES))

        def codes_of(j, v):
            if not fused:
                return load_vector(q, (j * TILE + v * LANES) * 4)
            packed = builder.load(builder.inttoptr(address(q, (j // 2 if pairs else j) * TILE + v * LANES),
                                                   bytes_.as_pointer()), align=1)
            if not pairs:
                return builder.sitofp(builder.sext(packed, ints), vec)
            wide = builder.zext(packed, ints)
            nibble = (builder.and_(wide, ir.Constant(ints, [15] * LANES)) if j % 2 == 0
                      else builder.lshr(wide, ir.Constant(ints, [4] * LANES)))
            return builder.sitofp(nibble, vec)

        x_rows = [address(x, builder.mul(x_stride, ir.Constant(i64, i))) for i in range(rows)]
        totals = [[ir.Constant(vec, [0.0] * LANES) for _ in range(vectors)] for _ in range(rows)]
        for j, k in enumerate(order):
            codes = [codes_of(j, v) for v in range(vectors)]
            for i in range(rows):
                xv = broadcast(x_rows[i], k * 4)
                for v, code in enumerate(codes):
                    totals[i][v] = builder.call(fma, [code, xv, totals[i][v]])
        for i in range(rows):
            xs = broadcast(address(xsum, builder.mul(xsum_stride, ir.Constant(i64, i))), 0) if offsets else None
            for v in range(vectors):
                term = builder.fmul(load_vector(d, v * LANES * 4), totals[i][v])
                if offsets:
                    term = builder.fadd(term, builder.fmul(load_vector(m, v * LANES * 4), xs))
                target = builder.inttoptr(address(acc, (i * TILE + v * LANES) * 4), vec.as_pointer())
                builder.store(builder.fadd(builder.load(target, align=4), term), target, align=4)

    def typer(typingctx, rows, q, x, x_stride, d, m, xsum, xsum_stride, acc):
        return types.void(*([types.int64] * 9)), rows_switch(most, block)

    return intrinsic(typer)


def rows_switch(most: int, block):
    """An intrinsic's codegen: straight-line code for each row count 1..most (block(builder, rows, *the other
    arguments)), chosen by a switch on the first argument (int64)."""
    def codegen(context, builder, signature, args):
        done = builder.append_basic_block("done")
        cases = [builder.append_basic_block(f"rows{rows}") for rows in range(1, most + 1)]
        switch = builder.switch(args[0], cases[0])
        for rows, case in enumerate(cases, 1):
            switch.add_case(ir.Constant(ir.IntType(64), rows), case)
            with builder.goto_block(case):
                block(builder, rows, *args[1:])
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return codegen

"""Several rows times the packed weights in int8: AVX-512 VNNI's vpdpbusd on the packed codes as they lie.

Only for decode rows of several sequences (int8_rows.py says where): each row's activations are quantised per
group of 32 inputs to int8 with one float32 scale s (s = max |x| / 127, q = x / s rounded half away from zero), and a weight group's
contribution to output r of row i is
    u4 (Q4_0, Q4_1, Q4_K; codes c in 0..15, w = d c + m):   d[r] s_i (sum_j c[j, r] q_i[j]) + m[r] s_i (sum_j q_i[j])
    i8 (Q8_0, Q5_0, Q6_K; signed codes c, w = d c):          d[r] s_i (sum_j c[j, r] q_i[j])
the integer sums exact (int32), the scaling in float32 (fused multiply-adds), llama.cpp's arithmetic. vpdpbusd
multiplies 4 unsigned bytes by 4 signed bytes in each 32-bit lane and adds the 4 products to the lane: it needs 4
codes of one output row side by side, where the packed layout (weight_kernels.py: `qs[tile, group, j, r]`, 64 rows
of one code byte a line) has one. So each group's code lines are turned in registers, 4 lines at a time: two rounds
of unpacks (bytes, then 16-bit pairs) give 4 vectors whose 32-bit lanes hold 4 consecutive codes of one row,
    vector k, lane 4 L + i  <-  row 16 L + 4 k + i        (L: the 128-bit lane, i < 4)
(unpacks work within 128-bit lanes; no other copy of the weights is made, the turn serves every row of the batch).
u4 bytes hold two codes (j low, j + 16 high): masked and shifted, each turned vector gives codes j..j+3 and
j+16..j+19. i8 codes are signed: flipped to c + 128 (unsigned) and the row's sums started at -128 sum_j q[j].
The group's scales d, m (64 rows, natural order) are turned the same way (a 4 x 4 transpose of 128-bit lanes maps
natural to turned order and back), the tile's float sums kept in turned order and turned back once a tile.

Per group: `_split` turns the codes (and d, m) into a 2.5 KiB block in L1; `_dots` runs blocks of ROWS rows over it,
each row's 4 accumulators of 16 int32 in registers, one vpdpbusd per code vector and row (64 multiply-adds).
Compiled only on a CPU with avx512_vnni (int8_rows.route), kept in numba's on-disk cache like the other kernels.

Measured (Zen 5 EPYC, one thread, load 1.5-6): every SmolLM2 product of a token, exact float32 batch kernels /
these: 2 rows 5.9 / 4.6 ms, 4 rows 9.1 / 5.1, 8 rows 16.0 / 6.8, 16 rows 28.3 / 11.2 (one row, the matrix-vector
kernel: 5.2). A 3072 x 576 Q4_1 product at 16 rows runs at ~280-320 GMAC/s against vpdpbusd's ~505 alone (2 a
cycle): the per-group scaling is ~17% of the time (measured without it), the turn of the codes and the scales'
conversion shared by the rows most of the rest; blocks of 2, 4 or 6 rows measured alike.

Measured (Intel Xeon, Emerald Rapids, KVM; one thread, the thread's CPU time, best of 21, load 3-3.6): vpdpbusd.512
alone peaks at ~7.1 G a second (~455 GMAC/s, two a cycle: ports 0 and 5); these kernels run SmolLM2's Q4_1 products at
~150-160 GMAC/s at 8 rows and ~210-235 at 16, its Q8_0 logits (28 MB, from memory) at ~145 / ~190; every product of a
token ~6.2 ms at 8 rows, ~10.6 at 16. On these cores the scaling's float operations (a conversion, a multiply and
two fused adds per 16 outputs, row and group) and the turn's shuffles share ports 0 and 5 with vpdpbusd: per row and
group 32 vpdpbusd and 16 float operations, per group ~120 operations of the turn shared by the rows, and the kernels
reach ~85% of that bound (measured without the scaling: 15-25% less time; turning a tile's codes once instead of
each group's: 10-20% less at 8 rows). Tried here and dropped (no gain): blocks of 2, 5 or 6 rows, the work area
aligned to 64 bytes, prefetching the codes into L2 16 KiB ahead as well. The row's term s qsum (u4) or -128 qsum
(i8) is computed once when the row is quantised, not per tile: 2-5% less time at 8 and 16 rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from pagevis.kernel_intrinsics import call_address, pointer_to
from pagevis.model.batch_kernels import _i8_arrays, _nib_arrays, rows_switch
from pagevis.model.matrix_descriptor import DESCRIPTOR, I8, KIND, MODE, N_IN, PER, TILES
from pagevis.model.weight_kernels import HALF, Q4_0, SUPER, _nib_scales, _prefetch_ahead, _scales

TILE = 64
ROWS = 4  # rows whose accumulators (4 zmm each) a block holds
CODE_VECTORS = 32  # at most: 32 codes x 64 rows / 64 bytes
SCRATCH = (CODE_VECTORS + 8) * 64  # the turned codes, then d and m in turned order
# A product's handle for `pool_kernel` (int64 words, `handle()`): the addresses of the arrays the rows are quantised
# into (the matrix: its descriptor, matrix_descriptor.py, the kernels' job)
XQ, SX, SUMS = range(3)
HANDLE = 3

_I8T, _I16T, _I32T, _I64T, _F32T = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_BYTES, _WORDS = ir.VectorType(_I8T, 64), ir.VectorType(_I16T, 32)
_DWORDS, _FLOATS = ir.VectorType(_I32T, 16), ir.VectorType(_F32T, 16)


def _unpack(builder, a, b, per_lane: int, high: bool):
    """x86's unpack (lo or hi) of two vectors of per_lane elements a 128-bit lane, as a shuffle."""
    half = per_lane // 2
    mask = [n + source * 4 * per_lane + lane * per_lane + (half if high else 0)
            for lane in range(4) for n in range(half) for source in (0, 1)]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32T, len(mask)), mask))


def _turn_lanes(builder, vectors):
    """The 4 x 4 transpose of 128-bit lanes: result k's lane l is vectors[l]'s lane k (its own inverse)."""
    lanes = ir.VectorType(_I32T, 16)
    out = []
    for k in range(4):
        pick = [4 * k + e for e in range(4)] + [16 + 4 * k + e for e in range(4)] + [0] * 8
        ab = builder.shuffle_vector(vectors[0], vectors[1], ir.Constant(lanes, pick))
        cd = builder.shuffle_vector(vectors[2], vectors[3], ir.Constant(lanes, pick))
        out.append(builder.shuffle_vector(ab, cd, ir.Constant(lanes, list(range(8)) + list(range(16, 24)))))
    return out


def _pointer(builder, base, offset, kind):
    address = builder.add(base, offset if isinstance(offset, ir.Value) else ir.Constant(_I64T, offset))
    return builder.inttoptr(address, kind.as_pointer())


def _load(builder, base, offset, kind, align=1):
    return builder.load(_pointer(builder, base, offset, kind), align=align)


def _split(lines: int, nibbles: bool, halves: bool = False):
    """An intrinsic (q, d, m, scratch): the group's `lines` code lines at q (64 bytes each) turned into code
    vectors at scratch (vector v at scratch + 64 v, see `_offsets` for the inputs each pairs with), and d, m
    (64 float32 each; halves: 64 float16 bit patterns each, the file's, converted here (vcvtph2ps: exact)) in
    turned order after the CODE_VECTORS vectors (m skipped for i8: d passed twice)."""
    def scale_lanes(builder, scales):
        if not halves:
            return [builder.bitcast(_load(builder, scales, v * 64, _FLOATS, 4), _DWORDS) for v in range(4)]
        bits = [_load(builder, scales, v * 32, ir.VectorType(_I16T, 16), 2) for v in range(4)]
        return [builder.bitcast(builder.fpext(builder.bitcast(b, ir.VectorType(ir.HalfType(), 16)), _FLOATS),
                                _DWORDS) for b in bits]

    def codegen(context, builder, signature, args):
        q, d, m, scratch = args
        low4 = ir.Constant(_DWORDS, [0x0F0F0F0F] * 16)
        flip = ir.Constant(_DWORDS, [-0x7F7F7F80] * 16)  # 0x80808080
        vector = 0
        for jb in range(lines // 4):
            rows = [_load(builder, q, (4 * jb + e) * 64, _BYTES) for e in range(4)]
            pairs = [_unpack(builder, rows[a], rows[a + 1], 16, high) for a in (0, 2) for high in (False, True)]
            words = [builder.bitcast(p, _WORDS) for p in pairs]  # lo01, hi01, lo23, hi23
            turned = [builder.bitcast(_unpack(builder, words[h], words[2 + h], 8, high), _DWORDS)
                      for h in (0, 1) for high in (False, True)]  # rows 16L + 4k + i for k = 0..3
            if nibbles:
                halves = [[builder.and_(t, low4) for t in turned],
                          [builder.and_(builder.lshr(t, ir.Constant(_DWORDS, [4] * 16)), low4) for t in turned]]
            else:
                halves = [[builder.xor(t, flip) for t in turned]]
            for half in halves:
                for k, codes in enumerate(half):
                    builder.store(codes, _pointer(builder, scratch, (vector * 4 + k) * 64, _DWORDS), align=4)
                vector += 1
        for n, scales in enumerate((d, m) if nibbles else (d,)):
            for k, turned in enumerate(_turn_lanes(builder, scale_lanes(builder, scales))):
                at = (CODE_VECTORS + 4 * n + k) * 64
                builder.store(turned, _pointer(builder, scratch, at, _DWORDS), align=4)
        return context.get_dummy_value()

    def typer(typingctx, q, d, m, scratch):
        return types.void(types.int64, types.int64, types.int64, types.int64), codegen

    return intrinsic(typer)


def _offsets(lines: int, nibbles: bool) -> list[int]:
    """The input offset (in the group) of the 4 codes each block of 4 code vectors `_split` wrote holds."""
    if nibbles:
        return [16 * h + 4 * jb for jb in range(lines // 4) for h in (0, 1)]
    return [4 * jb for jb in range(lines // 4)]


def _dots(lines: int, nibbles: bool):
    """An intrinsic (rows, scratch, xq, xq_stride, sx, sx_stride, qsum, qsum_stride, acc): for rows i < rows (1 to
    ROWS) and the tile's 64 outputs (turned order), acc[i] += d s_i (codes . q_i) (+ m s_i qsum_i for u4; for i8 the
    integer sums start at -128 qsum_i), the codes `_split` left in scratch. Addresses (int64) and byte strides:
    xq, row 0's first int8 input of the group; sx, its scale; qsum, its term of the group's int8 inputs as
    `_quantise_group` left it (u4: s_i qsum_i in float32; i8: -128 qsum_i); acc, row 0's 64 float32 sums (row i at
    acc + 256 i)."""
    offsets = _offsets(lines, nibbles)

    def block(builder, rows, scratch, xq, xq_stride, sx, sx_stride, qsum, qsum_stride, acc):
        vnni = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", (), ir.FunctionType(
            _DWORDS, [_DWORDS, _DWORDS, _DWORDS]))

        def row(base, stride, i):
            return builder.add(base, builder.mul(stride, ir.Constant(_I64T, i)))

        def splat(value, kind):
            one = builder.insert_element(ir.Constant(kind, None), value, ir.Constant(_I32T, 0))
            return builder.shuffle_vector(one, ir.Constant(kind, None), ir.Constant(_DWORDS, [0] * 16))

        if nibbles:
            accs = [[ir.Constant(_DWORDS, [0] * 16)] * 4 for _ in range(rows)]
        else:  # the row's -128 qsum, as `_quantise_group` left it
            accs = [[splat(_load(builder, row(qsum, qsum_stride, i), 0, _I32T, 4), _DWORDS)] * 4 for i in range(rows)]
        for b, offset in enumerate(offsets):
            inputs = [splat(_load(builder, row(xq, xq_stride, i), offset, _I32T), _DWORDS) for i in range(rows)]
            for k in range(4):
                codes = _load(builder, scratch, (b * 4 + k) * 64, _DWORDS, 4)
                for i in range(rows):
                    accs[i][k] = builder.call(vnni, [accs[i][k], codes, inputs[i]])
        fma = builder.module.declare_intrinsic("llvm.fma.v16f32", (), ir.FunctionType(_FLOATS, [_FLOATS] * 3))
        d = [_load(builder, scratch, (CODE_VECTORS + k) * 64, _FLOATS, 4) for k in range(4)]
        m = [_load(builder, scratch, (CODE_VECTORS + 4 + k) * 64, _FLOATS, 4) for k in range(4)] if nibbles else d
        for i in range(rows):
            s = splat(_load(builder, row(sx, sx_stride, i), 0, _F32T, 4), _FLOATS)
            term = splat(_load(builder, row(qsum, qsum_stride, i), 0, _F32T, 4), _FLOATS) if nibbles else None
            for k in range(4):
                target = _pointer(builder, row(acc, ir.Constant(_I64T, TILE * 4), i), k * 64, _FLOATS)
                total = builder.call(fma, [builder.fmul(d[k], s), builder.sitofp(accs[i][k], _FLOATS),
                                           builder.load(target, align=4)])
                if nibbles:
                    total = builder.call(fma, [m[k], term, total])
                builder.store(total, target, align=4)

    def typer(typingctx, rows, scratch, xq, xq_stride, sx, sx_stride, qsum, qsum_stride, acc):
        return types.void(*([types.int64] * 9)), rows_switch(ROWS, block)

    return intrinsic(typer)


@intrinsic
def _unturn(typingctx, turned, out):
    """out's 64 float32 (natural order) from a tile's sums in turned order (the lane transpose, then the rows
    4 k + i of each 128-bit lane L back to 16 L + 4 k + i: the same 4 x 4 transpose of lanes)."""
    def codegen(context, builder, signature, args):
        lanes = [builder.bitcast(_load(builder, args[0], v * 64, _FLOATS, 4), _DWORDS) for v in range(4)]
        for v, vector in enumerate(_turn_lanes(builder, lanes)):
            builder.store(builder.bitcast(vector, _FLOATS), _pointer(builder, args[1], v * 64, _FLOATS), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


_U4_SPLIT, _U4_DOTS = _split(16, True), _dots(16, True)
_I8_SPLIT, _I8_DOTS = _split(32, False), _dots(32, False)
_U4_SPLIT_HALVES, _I8_SPLIT_HALVES = _split(16, True, True), _split(32, False, True)  # Q4_1; Q8_0, Q5_0
_I8_16_SPLIT, _I8_16_DOTS = _split(16, False), _dots(16, False)


_AS_I64, _AS_I32, _AS_I16 = pointer_to(types.int64), pointer_to(types.int32), pointer_to(types.int16)
_AS_I8, _AS_U8, _AS_F32 = pointer_to(types.int8), pointer_to(types.uint8), pointer_to(types.float32)


def _halves(builder, x, at):
    return [_load(builder, x, at + 64 * v, _FLOATS, 4) for v in (0, 1)]


def _magnitudes(builder, x, at):
    """The group of 32 float32 at x + at: its two halves, and each lane's larger magnitude of the two (as bits: a
    finite float's magnitude orders as its bits do)."""
    halves = _halves(builder, x, at)
    magnitude = [builder.and_(builder.bitcast(h, _DWORDS), ir.Constant(_DWORDS, [0x7FFFFFFF] * 16)) for h in halves]
    return halves, builder.select(builder.icmp_unsigned(">", *magnitude), *magnitude)


def _inverse(builder, top, zero, fill):
    """127 / top, 0 where top is 0 (an all-zero group: codes 0)."""
    return builder.select(builder.fcmp_ordered(">", top, zero), builder.fdiv(fill(127.0), top), zero)


def _group_codes(builder, halves, inverse):
    """The group's codes as int32 lanes, its two halves': int(x inverse +- 0.5), truncated (rounded half away from
    zero; the half's sign taken from the product's bits: -0.0 gives -0.5, whose code is 0 as +0.5's is)."""
    spread = builder.shuffle_vector(builder.insert_element(ir.Constant(_FLOATS, None), inverse, ir.Constant(_I32T, 0)),
                                    ir.Constant(_FLOATS, None), ir.Constant(_DWORDS, [0] * 16))
    codes = []
    for h in halves:
        scaled = builder.fmul(h, spread)
        sign = builder.and_(builder.bitcast(scaled, _DWORDS), ir.Constant(_DWORDS, [-0x80000000] * 16))
        nudge = builder.bitcast(builder.or_(sign, ir.Constant(_DWORDS, [0x3F000000] * 16)), _FLOATS)  # +-0.5
        codes.append(builder.fptosi(builder.fadd(scaled, nudge), _DWORDS))
    return codes


def _store_codes(builder, codes, xq, at):
    """int32 codes (each within -127..127) as bytes at xq + at, 16 a vector."""
    for v, c in enumerate(codes):
        builder.store(builder.trunc(c, ir.VectorType(_I8T, 16)),
                      _pointer(builder, xq, at + 16 * v, ir.VectorType(_I8T, 16)), align=1)


def _store_packed_codes(builder, codes, xq, at):
    """Two groups' int32 codes (4 vectors, each within -127..127) as 64 bytes at xq + at: two saturating packs
    (exact here) and one permutation, where truncating each vector takes two shuffles of its own."""
    words = [builder.call(builder.module.declare_intrinsic("llvm.x86.avx512.packssdw.512", (), ir.FunctionType(
        _WORDS, [_DWORDS, _DWORDS])), pair) for pair in (codes[:2], codes[2:])]
    packed = builder.call(builder.module.declare_intrinsic("llvm.x86.avx512.packsswb.512", (), ir.FunctionType(
        _BYTES, [_WORDS, _WORDS])), words)
    # per 128-bit lane L the packs leave codes[m][4L:4L+4] in dword 4L + m; its place is dword 4m + L
    order = ir.Constant(_DWORDS, [4 * lane + m for m in range(4) for lane in range(4)])
    placed = builder.shuffle_vector(builder.bitcast(packed, _DWORDS), ir.Constant(_DWORDS, None), order)
    builder.store(placed, _pointer(builder, xq, at, _DWORDS), align=1)


def _store_terms(builder, s, totals, sums, nibbles: bool, kind):
    """The terms `_dots` starts from, of code sums totals with scale s, at sums: s qsum (float32, u4) or -128 qsum
    (int32, i8); kind the float type of s (a scalar, or a vector of 16 groups')."""
    if nibbles:
        builder.store(builder.fmul(s, builder.sitofp(totals, kind)), _pointer(builder, sums, 0, kind), align=4)
    else:
        spread = ir.Constant(totals.type, -128 if totals.type == _I32T else [-128] * 16)
        builder.store(builder.mul(totals, spread), _pointer(builder, sums, 0, totals.type), align=4)


def _quantise_group(size: int, nibbles: bool):
    """An intrinsic (x, xq, scale, sums): the 32 float32 inputs at x as int8 codes q = x / s rounded half away from
    zero into xq, s = max |x| / 127 into scale (0 for an all-zero group: codes 0), and the term `_dots` starts from
    of each `size` inputs (32, or Q6_K's 16) into sums: for a u4 matrix (nibbles) s qsum (float32, the product the
    kernel took per row and group before: computed once here), for i8 -128 qsum (int32), qsum the sum of the codes;
    in registers, where numba's loops left the largest magnitude a chain of 32 scalar compares (~0.6-0.9 ns an
    input). The arithmetic is a float32 loop's, unfused: s = top / 127, each code int(x (127 / top) +- 0.5),
    truncated. `_quantise_block` quantises 16 groups of 32 at once, to the same bits."""
    def codegen(context, builder, signature, args):
        x, xq, scale, sums = args
        halves, larger = _magnitudes(builder, x, 0)
        reduce_max = builder.module.declare_intrinsic("llvm.vector.reduce.umax.v16i32", (), ir.FunctionType(_I32T, [_DWORDS]))
        top = builder.bitcast(builder.call(reduce_max, [larger]), _F32T)
        s = builder.fdiv(top, ir.Constant(_F32T, 127.0))
        builder.store(s, _pointer(builder, scale, 0, _F32T), align=4)
        codes = _group_codes(builder, halves, _inverse(builder, top, ir.Constant(_F32T, 0.0),
                                                       lambda v: ir.Constant(_F32T, v)))
        _store_codes(builder, codes, xq, 0)
        reduce_add = builder.module.declare_intrinsic("llvm.vector.reduce.add.v16i32", (), ir.FunctionType(_I32T, [_DWORDS]))
        totals = [builder.call(reduce_add, [builder.add(*codes)])] if size == 32 else [
            builder.call(reduce_add, [c]) for c in codes]
        for v, total in enumerate(totals):
            _store_terms(builder, s, total, builder.add(sums, ir.Constant(_I64T, 4 * v)), nibbles, _F32T)
        return context.get_dummy_value()

    def typer(typingctx, x, xq, scale, sums):
        return types.void(*([types.int64] * 4)), codegen

    return intrinsic(typer)


def _lanes_reduced(builder, vectors, combine):
    """16 vectors of 16 int32 reduced to one whose lane j combines vector j's 16 lanes: a tree of 15 combines of
    two shuffles each (each level halves the lanes a vector's partial results take), where reducing each vector
    alone takes 4 shuffles and 4 combines."""
    level, width = list(vectors), 16  # each vector of level holds 16 // width vectors' partials, width lanes each
    while len(level) > 1:
        half, blocks = width // 2, 16 // width
        picks = [[source * 16 + block * width + first + e for source in (0, 1) for block in range(blocks)
                  for e in range(half)] for first in (0, half)]
        level = [combine(*(builder.shuffle_vector(a, b, ir.Constant(_DWORDS, pick)) for pick in picks))
                 for a, b in zip(level[0::2], level[1::2])]
        width = half
    return level[0]


def _quantise_block(nibbles: bool):
    """An intrinsic (x, xq, scale, sums): 16 consecutive groups of 32 inputs at x (a row's, or the next rows': the
    rows are C-contiguous) quantised as `_quantise_group` (size 32) quantises each, to the same bits: their largest
    magnitudes and code sums reduced for the 16 groups at once (`_lanes_reduced`), their 16 scales and terms divided,
    converted and stored as one vector each (a group alone: two horizontal reductions, two scalar divisions), the
    codes stored two groups a time (`_store_packed_codes`). Measured (Xeon, one thread, CPU time, best of 15, load
    1.4-3): 16 rows of 576 inputs 2.24 -> 1.09 us, of 1536 6.2 -> 3.0 us (8.0 -> 3.8 ns a group); one row of 576
    0.15 -> 0.08-0.10 us (16 groups in a block, 2 alone). ~24 vector operations a group remain, on the two ports
    that run 512-bit operations (ports 0 and 5)."""
    def codegen(context, builder, signature, args):
        x, xq, scale, sums = args
        tops = builder.bitcast(_lanes_reduced(builder, [_magnitudes(builder, x, 128 * j)[1] for j in range(16)],
                                              lambda a, b: builder.select(builder.icmp_unsigned(">", a, b), a, b)),
                               _FLOATS)
        s = builder.fdiv(tops, ir.Constant(_FLOATS, [127.0] * 16))
        builder.store(s, _pointer(builder, scale, 0, _FLOATS), align=4)
        inverse = _inverse(builder, tops, ir.Constant(_FLOATS, [0.0] * 16), lambda v: ir.Constant(_FLOATS, [v] * 16))
        totals = []
        for j in range(0, 16, 2):  # the inputs loaded again (as many registers as there are: 32 vectors)
            codes = [c for k in (j, j + 1) for c in _group_codes(builder, _halves(builder, x, 128 * k),
                                                                 builder.extract_element(inverse, ir.Constant(_I32T, k)))]
            _store_packed_codes(builder, codes, xq, 32 * j)
            totals += [builder.add(*codes[:2]), builder.add(*codes[2:])]
        _store_terms(builder, s, _lanes_reduced(builder, totals, builder.add), sums, nibbles, _FLOATS)
        return context.get_dummy_value()

    def typer(typingctx, x, xq, scale, sums):
        return types.void(*([types.int64] * 4)), codegen

    return intrinsic(typer)


_QUANTISE_U4, _QUANTISE_I8, _QUANTISE_16 = _quantise_group(32, True), _quantise_group(32, False), _quantise_group(16, False)
_QUANTISE_U4_16, _QUANTISE_I8_16 = _quantise_block(True), _quantise_block(False)  # 16 groups at once


@njit(cache=True, nogil=True)
def _quantize_rows(x, size, nibbles, xq, scales, sums):
    """Each row of x (C-contiguous) quantised into xq, scales, sums, a group of 32 inputs at a time
    (`_quantise_group`: the terms of each group of `size` inputs, 32 or 16, for a u4 matrix (nibbles) or i8), 16
    groups at a time where the groups are 32 inputs (`_quantise_block`: the rows' groups one after another)."""
    n, inputs = x.shape
    total, at, codes = n * (inputs // 32), x.ctypes.data, xq.ctypes.data
    first = 0
    if size == 32:
        first = total - total % 16
        for k in range(0, first, 16):
            if nibbles:
                _QUANTISE_U4_16(at + 128 * k, codes + 32 * k, scales.ctypes.data + 4 * k, sums.ctypes.data + 4 * k)
            else:
                _QUANTISE_I8_16(at + 128 * k, codes + 32 * k, scales.ctypes.data + 4 * k, sums.ctypes.data + 4 * k)
    for k in range(first, total):
        if nibbles:
            _QUANTISE_U4(at + 128 * k, codes + 32 * k, scales.ctypes.data + 4 * k, sums.ctypes.data + 4 * k)
        elif size == 32:
            _QUANTISE_I8(at + 128 * k, codes + 32 * k, scales.ctypes.data + 4 * k, sums.ctypes.data + 4 * k)
        else:
            _QUANTISE_16(at + 128 * k, codes + 32 * k, scales.ctypes.data + 4 * k, sums.ctypes.data + 8 * k)


@njit(cache=True, nogil=True, inline="always")
def _unturn_rows(acc, out, t):
    for i in range(acc.shape[0]):
        _unturn(acc.ctypes.data + i * TILE * 4,  # type: ignore[call-arg]
                out.ctypes.data + i * out.strides[0] + t * TILE * 4)


@njit(cache=True, nogil=True, inline="always")
def _quantised_tiles(qs, dh, ds, mh, ms, per, mode, size, nibbles, xq, sx, sums, t0, t1, out):
    """Tiles t0..t1 of a u4 (nibbles: size 32, d and m from _nib_scales) or i8 (size 32 or 16, d from _scales)
    matrix times the rows quantised (xq, sx, sums: `_quantize_rows`'), into out's columns."""
    n, groups, inputs = xq.shape[0], qs.shape[1], xq.shape[1]
    work = np.empty(4 * TILE + SCRATCH // 4 + n * TILE, np.float32)  # one allocation a call (a chunk of the pool's)
    d, m, sup = work[:TILE], work[TILE:2 * TILE], work[2 * TILE:4 * TILE].reshape((2, TILE))
    scratch, acc = work[4 * TILE:4 * TILE + SCRATCH // 4], work[4 * TILE + SCRATCH // 4:].reshape((n, TILE))
    at, group_bytes, scales = scratch.ctypes.data, qs.shape[2] * TILE, sx.shape[1]
    for t in range(t0, t1):
        acc[:] = 0
        for g in range(groups):
            _prefetch_ahead(qs, t, g)
            q_at, s_at = qs.ctypes.data + (t * groups + g) * group_bytes, (g * size) // 32
            h_at = (t * dh.shape[1] + g) * TILE * 2  # (per 1: the group's float16 scales and offsets)
            if nibbles and per == 1 and mode == HALF:
                _U4_SPLIT_HALVES(q_at, dh.ctypes.data + h_at, mh.ctypes.data + h_at, at)
            elif not nibbles and per == 1:
                _I8_SPLIT_HALVES(q_at, dh.ctypes.data + h_at, dh.ctypes.data + h_at, at)
            elif nibbles:
                _nib_scales(dh, ds, mh, ms, per, mode, t, g, d, m, sup)
                _U4_SPLIT(q_at, d.ctypes.data, m.ctypes.data, at)
            else:
                _scales(dh, ds, per, t, g, d, sup[0])
                if size == 32:
                    _I8_SPLIT(q_at, d.ctypes.data, d.ctypes.data, at)
                else:
                    _I8_16_SPLIT(q_at, d.ctypes.data, d.ctypes.data, at)
            for i in range(0, n, ROWS):
                args = (min(ROWS, n - i), at, xq.ctypes.data + i * inputs + size * g, inputs,
                        sx.ctypes.data + (i * scales + s_at) * 4, scales * 4, sums.ctypes.data + (i * groups + g) * 4,
                        groups * 4, acc.ctypes.data + i * TILE * 4)
                if nibbles:
                    _U4_DOTS(*args)
                elif size == 32:
                    _I8_DOTS(*args)
                else:
                    _I8_16_DOTS(*args)
        _unturn_rows(acc, out, t - t0)


@njit(cache=True, nogil=True, inline="always")
def _group(words):
    """The inputs a row's code sum covers: Q6_K's 16, else 32 (words: the matrix's descriptor)."""
    return 16 if words[KIND] == I8 and words[PER] > 1 else 32


@njit(cache=True, nogil=True, inline="always")
def _quantised(words, h, n):
    """The arrays of the handle h that n rows times the matrix words describes are quantised into."""
    size, inputs = _group(words), words[N_IN]
    return (carray(_AS_I8(h[XQ]), (n, inputs)), carray(_AS_F32(h[SX]), (n, inputs // 32)),
            carray(_AS_I32(h[SUMS]), (n, inputs // size)))


@cfunc(types.void(*(types.int64,) * 7), cache=True, error_model="numpy")
def pool_kernel(job, at, n, t0, t1, target, stride):
    """Tiles t0..t1 of the matrix described at address job times its n rows quantised into the handle at `at`
    (`handle()`), into the rows of stride floats at target (columns t0 * TILE on): spin_pool's rows-kernel
    signature, so the pool's two threads share a product's tiles, each tile computed alike whichever thread
    computes it."""
    words = carray(_AS_I64(job), (DESCRIPTOR,))
    xq, sx, sums = _quantised(words, carray(_AS_I64(at), (HANDLE,)), n)
    out = carray(_AS_F32(target), (n, stride))[:, t0 * TILE:t1 * TILE]
    if words[KIND] == I8:
        qs, dh, ds = _i8_arrays(words)
        if words[PER] > 1:  # Q6_K
            _quantised_tiles(qs, dh, ds, ds, ds, 16, HALF, 16, False, xq, sx, sums, t0, t1, out)
        else:
            _quantised_tiles(qs, dh, ds, ds, ds, 1, HALF, 32, False, xq, sx, sums, t0, t1, out)
        return
    codes, _, dh, ds, mh, ms = _nib_arrays(words)
    if words[PER] > 1:  # Q4_K
        _quantised_tiles(codes, dh, ds, mh, ms, 8, SUPER, 32, True, xq, sx, sums, t0, t1, out)
    elif words[MODE] == Q4_0:
        _quantised_tiles(codes, dh, ds, mh, ms, 1, Q4_0, 32, True, xq, sx, sums, t0, t1, out)
    else:
        _quantised_tiles(codes, dh, ds, mh, ms, 1, HALF, 32, True, xq, sx, sums, t0, t1, out)


@njit(cache=True, nogil=True, inline="always")
def _quantise(job, at, n, x_address):
    """The n rows (C-contiguous) at x_address quantised into the arrays of the handle at `at`, for the matrix
    described at address job."""
    words = carray(_AS_I64(job), (DESCRIPTOR,))
    xq, sx, sums = _quantised(words, carray(_AS_I64(at), (HANDLE,)), n)
    _quantize_rows(carray(_AS_F32(x_address), (n, words[N_IN])), _group(words), words[KIND] != I8, xq, sx, sums)


@cfunc(types.void(*(types.int64,) * 7), cache=True, error_model="numpy")
def quantise_kernel(job, at, n, x_address, unused0, unused1, unused2):
    """The n rows at x_address quantised into the arrays of the handle at `at` (the matrix: job's): spin_pool's
    preparation of a job (its caller runs it before sharing the tiles), in the rows kernel's signature."""
    _quantise(job, at, n, x_address)


@njit("void(int64[::1], int64[::1], float32[:, ::1], float32[:, ::1], int64)", cache=True, nogil=True)
def product(job, h, x, out, kernel):
    """out (rows, the matrix's tiles x TILE) = the rows x times the matrix job describes on this thread: x quantised
    into the handle's arrays, every tile by pool_kernel (at address kernel), as the pool's two threads compute them."""
    _quantise(job.ctypes.data, h.ctypes.data, x.shape[0], x.ctypes.data)
    call_address(kernel, job.ctypes.data, h.ctypes.data, x.shape[0], 0, job[TILES],  # type: ignore[call-arg]
                 out.ctypes.data, out.shape[1])


def handle(quantised: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """pool_kernel's handle of the arrays rows are quantised into (codes, scales, sums: rows x n_in int8, rows x
    n_in / 32 float32, rows x n_in / `_group` int32, which hold `_quantise_group`'s terms, float32 bits for a u4
    matrix): addresses, so the arrays must outlive its use."""
    return np.array([array.ctypes.data for array in quantised], np.int64)


def compiled() -> dict:
    """The int8 rows' entries (int8_rows.product's), compiled or loaded from numba's on-disk cache (through
    kernel_loader.import_kernels): `product` on one thread, the addresses of the pool's kernel and preparation."""
    return {"product": product, "handle": handle, "pool": int(pool_kernel.address or 0),
            "prepare": int(quantise_kernel.address or 0)}

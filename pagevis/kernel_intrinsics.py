"""What the compiled kernels of the model (model/weight_kernels.py, fused_kernels.py) and of the cache
(kvcache/decode_kernel.py, policies/kernels.py) share: two LLVM operations numba does not spell, one float32 exp that
vectorises, float16 read and written through its bits (numba has no float16 on the CPU: `widen`, `narrow`), the
njit options' type, and (the batched decode attention's) 16-lane vector loops spelt in LLVM's IR: dots16, weigh_rows,
lanes_peak, lanes_exps. Imported by both, so it builds on nothing of pagevis.

They are inlined into the kernels that call them, and numba's on-disk cache does not notice a change here: change
one only together with the kernels' files (or clear the cache).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any, Literal, TypedDict, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

LOG2E = np.float32(1.4426950408889634)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 in two parts (Cephes)


class NjitOptions(TypedDict, total=False):
    """The njit options a kernel module compiles with, as one dict (named so a type checker matches it to njit's)."""
    cache: bool
    nogil: bool
    fastmath: bool | set[str]
    error_model: Literal["python", "numpy"]
    boundscheck: bool


@intrinsic
def bits_as_float32(typingctx, bits):
    """The float32 whose bits are the int32 bits (LLVM's bitcast: no instruction)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _float32_bits(typingctx, value):
    """The int32 bits of the float32 value (LLVM's bitcast: no instruction)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


HALF_SCALE = 2.0 ** 112  # a float16's exponent bits read as a float32's: its value times 2^-112


HALF_INSTRUCTIONS: bool | None = None  # widen's choice: None, by the CPU (`_converts_halves`); tests force the bits'


def _converts_halves(context) -> bool:
    """Whether the CPU numba compiles for converts float16 to float32 in one instruction (x86's F16C: vcvtph2ps;
    AArch64's fcvt), which LLVM's fpext from half then is; elsewhere it would call a runtime function."""
    if HALF_INSTRUCTIONS is not None:
        return HALF_INSTRUCTIONS
    features = getattr(context.codegen(), "_tm_features", "") or ""
    return "+f16c" in features.split(",") or platform.machine().lower() in ("aarch64", "arm64")


@intrinsic
def _widen(typingctx, value):
    """A stored K/V element as float32: a float32 itself; a uint16 (a float16's bits: float16 pages are read through a
    uint16 view) exactly: LLVM's fpext from half where the CPU converts in one instruction (`_converts_halves`: F16C's
    vcvtph2ps converts 16 a time), else as bits ((h & 0x7fff) << 13 | (h & 0x8000) << 16), a float32 2^112 times too
    small for a normal, zero or subnormal float16 alike, times 2^112 (a float16 is never inf or NaN here: none is
    stored): integer operations and one product carrying no fast-math flag (so no reassociation moves the 2^112 out of
    it and under float32's range). LLVM vectorises either."""
    if value == types.float32:
        def same(context, builder, signature, args):
            return args[0]
        return types.float32(value), same
    if value != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        if _converts_halves(context):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        i32 = ir.IntType(32)
        h = builder.zext(args[0], i32)
        magnitude = builder.shl(builder.and_(h, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
        sign = builder.shl(builder.and_(h, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        small = builder.bitcast(builder.or_(magnitude, sign), ir.FloatType())
        return builder.fmul(small, ir.Constant(ir.FloatType(), HALF_SCALE))
    return types.float32(value), codegen


# numba's stub types an intrinsic's call with its typing function's parameters (typingctx first): these names give
# the calls' own signature
float32_bits: Callable[[Any], Any] = cast(Callable[[Any], Any], _float32_bits)
widen: Callable[[Any], Any] = cast(Callable[[Any], Any], _widen)


@njit(cache=True, nogil=True)
def half_bits(value):  # pragma: no cover (numba)
    """The bits (uint16) of float32 value rounded to float16 to the nearest, ties to even: NumPy's astype(float16), bit
    for bit (beyond float16's range inf; a NaN a NaN). F. Giesen's float_to_half_fast3_rtne: a result that is
    subnormal is rounded by a float32 sum (value + 0.5: its low bits are the float16's), any other by adding 0xfff
    and the kept mantissa's lowest bit below the cut. Not inlined (no caller's fast-math flags on its sum)."""
    bits = float32_bits(value)
    sign = (bits >> 16) & 0x8000
    f = bits & 0x7FFFFFFF
    if f >= 0x47800000:  # 2^16 and above (and inf, NaN)
        out = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:  # below 2^-14: a subnormal float16 or zero
        out = float32_bits(bits_as_float32(f) + np.float32(0.5)) - 0x3F000000  # type: ignore[call-arg]
    else:
        out = (f + (np.int32(-112) << 23) + 0xFFF + ((f >> 13) & 1)) >> 13
    return np.uint16(out | sign)


def narrow(value, array):
    """value (float32) as an element of `array`: itself into float32, half_bits into uint16 (float16 pages' bits);
    compiled code only (kernels writing K/V into float32 or float16 pages)."""
    raise NotImplementedError


@overload(narrow, inline="always")
def _narrow(value, array):
    if array.dtype == types.uint16:
        return lambda value, array: half_bits(value)
    return lambda value, array: value


@intrinsic
def call_address(typingctx, function, a, b, c, d, e, f, g):
    """The C function at address `function` (seven int64 arguments, no result) called with the other arguments: a
    kernel compiled once (a cfunc) called from others without numba linking its code into each."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        kind = ir.FunctionType(ir.VoidType(), [i64] * 7)
        builder.call(builder.inttoptr(args[0], kind.as_pointer()), args[1:])
        return context.get_dummy_value()
    return types.void(*(types.int64,) * 8), codegen


def pointer_to(numba_type):
    """An intrinsic: the address (int64) as a pointer to numba_type (for numba's carray)."""
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(numba_type).as_pointer())
        return types.CPointer(numba_type)(types.int64), codegen
    return pointer


def _prefetch_into(locality: int):
    """An intrinsic asking for the cache line at an address (int64) ahead of its use, with LLVM's prefetch locality
    (3: every level, prefetcht0; 2: from the second level out, prefetcht1): a hint, no fault whatever the address."""
    @intrinsic
    def prefetch_line(typingctx, address):
        def codegen(context, builder, signature, args):
            pointer = ir.IntType(8).as_pointer()
            kind = ir.FunctionType(ir.VoidType(), [pointer, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
            function = builder.module.declare_intrinsic("llvm.prefetch", [pointer], kind)
            read, keep, data = (ir.Constant(ir.IntType(32), v) for v in (0, locality, 1))
            builder.call(function, [builder.inttoptr(args[0], pointer), read, keep, data])
            return context.get_dummy_value()
        return types.void(types.int64), codegen
    return prefetch_line


prefetch = _prefetch_into(3)
# Into the second-level cache: a request that does not hold one of the first level's few miss buffers, so a core
# streaming a matrix from memory keeps more lines in flight (Emerald Rapids, Gemma 3's 178 MB logits matrix, one
# thread: 11.4-11.6 GB/s against 9.7 asking into the first level and 10.8 asking for nothing).
prefetch_l2 = _prefetch_into(2)


@njit(cache=True, nogil=True, inline="always")
def exp_in_range(x):  # pragma: no cover (numba)
    """exp(x) in float32 for x in [-87.3, 88.7] (the caller clamps: float32's normal range), as Cephes' expf:
    x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r times 2^n built in the exponent bits. Plain arithmetic
    (numba has no SVML here), so LLVM vectorises the loops that call it; within 2 ulp of exp."""
    n = np.floor(x * LOG2E + np.float32(0.5))
    r = x - n * LN2_HI - n * LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)  # exp(r); times 2^n:
    return p * bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # type: ignore[call-arg]


# 16-lane float32 vectors spelt in LLVM's IR (numba has no vector type): the decode kernels' dot products and
# weighted sums of a page's rows, whose loops LLVM's vectoriser lays out one reduction at a time
_LANES = 16
_FLOAT = ir.FloatType()
_VECTOR = ir.VectorType(_FLOAT, _LANES)


def _vector(builder, base, index):
    """The 16 floats at base (float*) + index (i64) as a vector (an unaligned load)."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), _VECTOR.as_pointer()), align=4)


def _fma(builder, a, b, c):
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3),
                                              "llvm.fma.v16f32")
    return builder.call(function, [a, b, c])


def _lane_sums(builder, vectors):
    """One vector whose lane s is the sum of vectors[s]'s lanes (16 vectors): each step adds the halves of two
    vectors' blocks side by side (two shuffles and one sum a pair: 15 pairs, where 16 horizontal sums take 64
    shuffles and sums)."""
    i32 = ir.IntType(32)
    width = _LANES // 2
    while width:
        blocks, low, high = _LANES // width, list[int](), list[int]()
        for block in range(blocks):  # the first half of the output's blocks from a, the second from b
            start = (0 if block < blocks // 2 else _LANES) + block % (blocks // 2) * 2 * width
            low += range(start, start + width)
            high += range(start + width, start + 2 * width)
        masks = [ir.Constant(ir.VectorType(i32, _LANES), [ir.Constant(i32, x) for x in m]) for m in (low, high)]
        vectors = [builder.fadd(builder.shuffle_vector(a, b, masks[0]), builder.shuffle_vector(a, b, masks[1]))
                   for a, b in zip(vectors[::2], vectors[1::2])]
        width //= 2
    return vectors[0]


@intrinsic
def _dots16(typingctx, out, q, k, d):
    """out[s] = q . k[s] for 16 float32 rows k (d floats each, at address k) and the row q (d floats), d a multiple of
    16 (addresses, int64; out: 16 floats): 16 accumulating vectors, then their lane sums side by side (`_lane_sums`)
    rather than one horizontal sum a row. Products fused, sums in any order."""
    def codegen(context, builder, signature, args):
        pointer = _FLOAT.as_pointer()
        out_at, q_at, k_at = (builder.inttoptr(a, pointer) for a in args[:3])
        d = args[3]
        zero = ir.Constant(_VECTOR, None)
        sums = [cgutils.alloca_once_value(builder, zero) for _ in range(_LANES)]
        with cgutils.for_range(builder, builder.udiv(d, ir.Constant(d.type, _LANES))) as loop:
            at = builder.mul(loop.index, ir.Constant(d.type, _LANES))
            row = _vector(builder, q_at, at)
            for s in range(_LANES):
                key = _vector(builder, k_at, builder.add(builder.mul(d, ir.Constant(d.type, s)), at))
                builder.store(_fma(builder, row, key, builder.load(sums[s])), sums[s])
        total = _lane_sums(builder, [builder.load(s) for s in sums])
        builder.store(total, builder.bitcast(out_at, _VECTOR.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


def _weigh_block(builder, acc, w, v, n, d, start, count):
    """acc[start + 16 c + j] += sum over s < n of w[s] v[s d + start + 16 c + j] for c < count: count vectors summed
    over the rows in registers, the even rows' and the odd rows' apart (twice the sums in flight), then together."""
    def row_sums(sums, s):
        weight = builder.load(builder.gep(w, [s]))
        spread = builder.shuffle_vector(builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), weight,
                                                               ir.Constant(ir.IntType(32), 0)),
                                        ir.Constant(_VECTOR, ir.Undefined),
                                        ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES))
        row = builder.add(builder.mul(s, d), start)
        for c in range(count):
            value = _vector(builder, v, builder.add(row, ir.Constant(d.type, 16 * c)))
            builder.store(_fma(builder, spread, value, builder.load(sums[c])), sums[c])

    one, two = ir.Constant(d.type, 1), ir.Constant(d.type, 2)
    even = [cgutils.alloca_once_value(builder, _vector(builder, acc, builder.add(start, ir.Constant(d.type, 16 * c))))
            for c in range(count)]
    odd = [cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, None)) for _ in range(count)]
    with cgutils.for_range(builder, builder.udiv(n, two)) as loop:
        s = builder.mul(loop.index, two)
        row_sums(even, s)
        row_sums(odd, builder.add(s, one))
    with cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.urem(n, two), ir.Constant(d.type, 0))):
        row_sums(even, builder.sub(n, one))
    for c in range(count):
        at = builder.gep(acc, [builder.add(start, ir.Constant(d.type, 16 * c))])
        builder.store(builder.fadd(builder.load(even[c]), builder.load(odd[c])), builder.bitcast(at, _VECTOR.as_pointer()),
                      align=4)


@intrinsic
def _weigh_rows(typingctx, acc, w, v, n, d):
    """acc[j] += sum over s < n of w[s] v[s][j] for float32 rows v (d floats each, at address v; only the first n
    read), d a multiple of 16 (addresses, int64): 64 columns at a time (four vectors summed in registers over the
    rows), then 16. Products fused, sums in any order."""
    def codegen(context, builder, signature, args):
        pointer = _FLOAT.as_pointer()
        acc_at, w_at, v_at = (builder.inttoptr(a, pointer) for a in args[:3])
        n, d = args[3], args[4]
        four = builder.udiv(d, ir.Constant(d.type, 4 * _LANES))
        with cgutils.for_range(builder, four) as loop:
            _weigh_block(builder, acc_at, w_at, v_at, n, d, builder.mul(loop.index, ir.Constant(d.type, 4 * _LANES)), 4)
        rest = builder.udiv(builder.urem(d, ir.Constant(d.type, 4 * _LANES)), ir.Constant(d.type, _LANES))
        with cgutils.for_range(builder, rest) as loop:
            start = builder.add(builder.mul(four, ir.Constant(d.type, 4 * _LANES)),
                                builder.mul(loop.index, ir.Constant(d.type, _LANES)))
            _weigh_block(builder, acc_at, w_at, v_at, n, d, start, 1)
        return context.get_dummy_value()
    return types.void(*(types.int64,) * 5), codegen


def _spread(builder, value, vector_type=_VECTOR):
    """value in every lane of a vector."""
    i32 = ir.IntType(32)
    lanes = vector_type.count
    one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def _larger(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def _lanes_peak(typingctx, row, blocks):
    """The max of the 16 blocks floats at address row (float32; -inf if blocks is 0), 16 at a time: a running max one
    float at a time does not vectorise (float32's max is not associative to LLVM without no-NaN flags)."""
    def codegen(context, builder, signature, args):
        at = builder.inttoptr(args[0], _FLOAT.as_pointer())
        peak = cgutils.alloca_once_value(builder, _spread(builder, ir.Constant(_FLOAT, float("-inf"))))
        with cgutils.for_range(builder, args[1]) as loop:
            block = _vector(builder, at, builder.mul(loop.index, ir.Constant(args[1].type, _LANES)))
            builder.store(_larger(builder, block, builder.load(peak)), peak)
        lanes = builder.load(peak)
        i32 = ir.IntType(32)
        width = _LANES // 2
        while width:  # halves folded onto each other
            upper = builder.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(i32, _LANES),
                                                                     [(x + width) % _LANES for x in range(_LANES)]))
            lanes = _larger(builder, lanes, upper)
            width //= 2
        return builder.extract_element(lanes, ir.Constant(i32, 0))
    return types.float32(types.int64, types.int64), codegen


@intrinsic
def _lanes_exps(typingctx, row, blocks, peak, floor):
    """row[t] = exp(row[t] - peak) for the 16 blocks floats at address row, 16 at a time (exp_in_range's Cephes
    polynomial, on the difference clamped at floor; exactly 0 below floor and for -inf): their sum."""
    def codegen(context, builder, signature, args):
        at = builder.inttoptr(args[0], _FLOAT.as_pointer())
        peak, floor = _spread(builder, args[2]), _spread(builder, args[3])
        i32v = ir.VectorType(ir.IntType(32), _LANES)

        def constant(x):
            return _spread(builder, ir.Constant(_FLOAT, float(x)))
        floor_function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR]),
                                                        "llvm.floor.v16f32")
        total = cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, None))
        with cgutils.for_range(builder, args[1]) as loop:
            where = builder.bitcast(builder.gep(at, [builder.mul(loop.index, ir.Constant(args[1].type, _LANES))]),
                                    _VECTOR.as_pointer())
            x = builder.fsub(builder.load(where, align=4), peak)
            kept = builder.fcmp_ordered(">=", x, floor)
            x = _larger(builder, x, floor)
            n = builder.call(floor_function, [_fma(builder, x, constant(LOG2E), constant(0.5))])
            r = _fma(builder, builder.fneg(n), constant(LN2_HI), x)
            r = _fma(builder, builder.fneg(n), constant(LN2_LO), r)
            p = constant(1.9875691500e-4)
            for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
                p = _fma(builder, p, r, constant(c))
            p = builder.fadd(_fma(builder, builder.fmul(p, r), r, r), constant(1))
            power = builder.shl(builder.add(builder.fptosi(n, i32v), _spread(builder, ir.Constant(ir.IntType(32), 127),
                                                                            i32v)),
                                _spread(builder, ir.Constant(ir.IntType(32), 23), i32v))
            e = builder.select(kept, builder.fmul(p, builder.bitcast(power, _VECTOR)), ir.Constant(_VECTOR, None))
            builder.store(e, where, align=4)
            builder.store(builder.fadd(builder.load(total), e), total)
        return _horizontal_sum(builder, builder.load(total))
    return types.float32(types.int64, types.int64, types.float32, types.float32), codegen


def _horizontal_sum(builder, lanes):
    i32 = ir.IntType(32)
    width = _LANES // 2
    while width:
        upper = builder.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(i32, _LANES),
                                                                 [(x + width) % _LANES for x in range(_LANES)]))
        lanes = builder.fadd(lanes, upper)
        width //= 2
    return builder.extract_element(lanes, ir.Constant(i32, 0))


# (as float32_bits and widen above: the calls' own signature)
dots16: Callable[..., Any] = cast(Callable[..., Any], _dots16)
weigh_rows: Callable[..., Any] = cast(Callable[..., Any], _weigh_rows)
lanes_peak: Callable[..., Any] = cast(Callable[..., Any], _lanes_peak)
lanes_exps: Callable[..., Any] = cast(Callable[..., Any], _lanes_exps)


def _weigh_heads_block(builder, acc, w, w_stride, heads, v, n, d, start, count):
    """acc[h d + start + 16 c + j] += sum over s < n of w[h w_stride + s] v[s d + start + 16 c + j] for h < heads,
    c < count: heads x count vectors summed over the rows in registers, each row's values read once for every head."""
    sums = [[cgutils.alloca_once_value(builder, _vector(builder, acc, builder.add(
        builder.mul(ir.Constant(d.type, h), d), builder.add(start, ir.Constant(d.type, 16 * c))))) for c in range(count)]
        for h in range(heads)]
    with cgutils.for_range(builder, n) as loop:
        row = builder.add(builder.mul(loop.index, d), start)
        values = [_vector(builder, v, builder.add(row, ir.Constant(d.type, 16 * c))) for c in range(count)]
        for h in range(heads):
            weight = builder.load(builder.gep(w, [builder.add(builder.mul(ir.Constant(d.type, h), w_stride), loop.index)]))
            spread = _spread(builder, weight)
            for c in range(count):
                builder.store(_fma(builder, spread, values[c], builder.load(sums[h][c])), sums[h][c])
    for h in range(heads):
        for c in range(count):
            at = builder.gep(acc, [builder.add(builder.mul(ir.Constant(d.type, h), d),
                                               builder.add(start, ir.Constant(d.type, 16 * c)))])
            builder.store(builder.load(sums[h][c]), builder.bitcast(at, _VECTOR.as_pointer()), align=4)


def _weigh_heads(heads: int):
    @intrinsic
    def weigh(typingctx, acc, w, w_stride, v, n, d):
        """weigh_rows for `heads` rows at once: acc[h][j] += sum over s < n of w[h w_stride + s] v[s][j] for h < heads
        (acc: heads rows of d floats, each after the other), each value row read once for all of them: 64 columns at
        a time (heads x 4 vectors in registers), then 16."""
        def codegen(context, builder, signature, args):
            pointer = _FLOAT.as_pointer()
            acc_at, w_at = (builder.inttoptr(a, pointer) for a in args[:2])
            w_stride, v_at, n, d = args[2], builder.inttoptr(args[3], pointer), args[4], args[5]
            four = builder.udiv(d, ir.Constant(d.type, 4 * _LANES))
            with cgutils.for_range(builder, four) as loop:
                _weigh_heads_block(builder, acc_at, w_at, w_stride, heads, v_at, n, d,
                                   builder.mul(loop.index, ir.Constant(d.type, 4 * _LANES)), 4)
            rest = builder.udiv(builder.urem(d, ir.Constant(d.type, 4 * _LANES)), ir.Constant(d.type, _LANES))
            with cgutils.for_range(builder, rest) as loop:
                start = builder.add(builder.mul(four, ir.Constant(d.type, 4 * _LANES)),
                                    builder.mul(loop.index, ir.Constant(d.type, _LANES)))
                _weigh_heads_block(builder, acc_at, w_at, w_stride, heads, v_at, n, d, start, 1)
            return context.get_dummy_value()
        return types.void(*(types.int64,) * 6), codegen
    return cast(Callable[..., Any], weigh)


# a GQA group's query heads at once (SmolLM2's 3, Gemma 3's 4): each value row read once for the group
weigh_heads3, weigh_heads4 = _weigh_heads(3), _weigh_heads(4)

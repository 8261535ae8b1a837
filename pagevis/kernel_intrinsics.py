"""What the compiled kernels of the model (model/weight_kernels.py, fused_kernels.py) and of the cache
(kvcache/decode_kernel.py, policies/kernels.py) share: two LLVM operations numba does not spell, one float32 exp that
vectorises, float16 read and written through its bits (numba has no float16 on the CPU: `widen`, `narrow`), and the
njit options' type. Imported by both, so it builds on nothing of pagevis.

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

"""What the compiled kernels of the model (model/weight_kernels.py, fused_kernels.py) and of the cache
(kvcache/decode_kernel.py, policies/kernels.py) share: two LLVM operations numba does not spell, one float32 exp that
vectorises, and the njit options' type. Imported by both, so it builds on nothing of pagevis.

They are inlined into the kernels that call them, and numba's on-disk cache does not notice a change here: change
one only together with the kernels' files (or clear the cache).
"""

from __future__ import annotations

from typing import Literal, TypedDict

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

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

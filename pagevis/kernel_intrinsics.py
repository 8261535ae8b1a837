"""Two LLVM operations numba does not spell, and the njit options' type, for the compiled kernels of the model
(model/weight_kernels.py, fused_kernels.py) and of the cache (kvcache/decode_kernel.py, policies/kernels.py):
imported by both, so it builds on nothing of pagevis.

They are inlined into the kernels that call them, and numba's on-disk cache does not notice a change here: change
one only together with the kernels' files (or clear the cache).
"""

from __future__ import annotations

from typing import Literal, TypedDict

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


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
def prefetch(typingctx, address):
    """Ask for the cache line at an address (int64) ahead of its use (LLVM's prefetch: a hint, no fault whatever
    the address)."""
    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()
        kind = ir.FunctionType(ir.VoidType(), [pointer, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        function = builder.module.declare_intrinsic("llvm.prefetch", [pointer], kind)
        read, keep, data = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
        builder.call(function, [builder.inttoptr(args[0], pointer), read, keep, data])
        return context.get_dummy_value()
    return types.void(types.int64), codegen

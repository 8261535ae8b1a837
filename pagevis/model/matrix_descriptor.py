"""A packed matrix's descriptor: its kernel arrays (quantized.QuantMatrix.arrays) as int64 words, addresses and
shapes, the one form in which C functions called through an address take a matrix (batch_kernels.rows_kernel, the
spin pool's row_kernel and its jobs). Plain NumPy: QuantMatrix builds its descriptor without loading a kernel.

The words: the kernel's family (NIB: u4 and u5; I8), HIGH (u5's high bits), PER (groups a float16 scale covers),
MODE (the scale mode: weight_kernels' HALF, Q4_0, SUPER), TILES, N_IN; then from ARRAYS the matrix's arrays, each
as its address and four dimensions (WORDS_AN_ARRAY words; fewer dimensions leave zeros): for NIB qs, qh, dh, ds,
mh, ms at NIB_QS ... NIB_MS, for I8 qs, dh, ds at I8_QS, I8_DH, I8_DS. batch_kernels' `_nib_arrays` and
`_i8_arrays` (numba, inlined into both kernels) read them back as arrays; the spin pool reads TILES of any job's
descriptor (the cache's attention kernels write theirs with DESCRIPTOR words and their tiles at TILES too).

numba compiles these words' positions into the kernels as constants: this module is one of kernel_sources' kernel
sources (it mentions numba), so changing it drops the kernels' on-disk cache like a change to a kernel module.
"""

from __future__ import annotations

import numpy as np

KIND, HIGH, PER, MODE, TILES, N_IN = range(6)
ARRAYS, WORDS_AN_ARRAY = 6, 5
DESCRIPTOR = ARRAYS + 6 * WORDS_AN_ARRAY
NIB, I8 = 0, 1
NIB_QS, NIB_QH, NIB_DH, NIB_DS, NIB_MH, NIB_MS = (ARRAYS + WORDS_AN_ARRAY * k for k in range(6))
I8_QS, I8_DH, I8_DS = (ARRAYS + WORDS_AN_ARRAY * k for k in range(3))


def describe(fmt: str, arrays: tuple, n_in: int) -> np.ndarray:
    """The descriptor of a packed matrix of format fmt (u4, u5, i8) and kernel arrays `arrays` (QuantMatrix.arrays:
    (qs, qh, dh, ds, mh, ms, high, per, mode) or (qs, dh, ds, per)); the arrays must outlive it (QuantMatrix keeps
    both)."""
    job = np.zeros(DESCRIPTOR, np.int64)
    if fmt == "i8":
        held, (job[KIND], job[PER]) = arrays[:3], (I8, arrays[3])
    else:
        held, (job[KIND], job[HIGH], job[PER], job[MODE]) = arrays[:6], (NIB, int(arrays[6]), arrays[7], arrays[8])
    job[TILES], job[N_IN] = arrays[0].shape[0], n_in
    for k, array in enumerate(held):
        if not array.flags.c_contiguous:
            raise ValueError("packed arrays are C-contiguous")
        at = ARRAYS + WORDS_AN_ARRAY * k
        job[at] = array.ctypes.data
        job[at + 1:at + 1 + array.ndim] = array.shape
    return job


def family(job: np.ndarray) -> str:
    """The weight family of a matrix's descriptor, which batch_kernels compiles a matrix-vector kernel and (u4, i8) a
    rows kernel for: u4 (Q4_1), q4_0, q4_k; u5 (Q5_1), q5_k; i8 (Q8_0, Q5_0), q6_k."""
    if job[KIND] == I8:
        return "q6_k" if job[PER] > 1 else "i8"
    if job[HIGH]:
        return "q5_k" if job[PER] > 1 else "u5"
    return "q4_k" if job[PER] > 1 else ("q4_0" if job[MODE] == 1 else "u4")  # weight_kernels' modes: Q4_0 = 1

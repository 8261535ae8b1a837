"""A packed matrix as the kernels see it (model/quantized.py, model/matrix_descriptor.py): its descriptor's words
name its arrays' addresses and shapes; every packed array starts on a 64-byte cache line, at the cost of its padding
only (a small matrix of each ggml type, and a loaded SmolLM2's every matrix)."""

from __future__ import annotations

import numpy as np
import pytest
from model_fixtures import smollm2  # noqa: F401  (fixture)
from test_weight_kernels import random_blocks

from pagevis.model import matrix_descriptor as md
from pagevis.model.quantized import ALIGN, FORMATS, PLACEHOLDERS, QuantMatrix, pack

KINDS = list(FORMATS)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_a_descriptor_names_each_packed_arrays_address_and_shape(kind):
    n_in = FORMATS[kind][3] * 2
    matrix = pack(kind, random_blocks(kind, 70, n_in, np.random.default_rng(int(kind))), n_in)
    words = matrix.descriptor
    assert words.shape == (md.DESCRIPTOR,) and words[md.TILES] == 2 and words[md.N_IN] == n_in
    if matrix.fmt == "i8":
        at = {md.I8_QS: matrix.arrays[0], md.I8_DH: matrix.arrays[1], md.I8_DS: matrix.arrays[2]}
        assert words[md.KIND] == md.I8 and words[md.PER] == matrix.arrays[3]
    else:
        at = dict(zip((md.NIB_QS, md.NIB_QH, md.NIB_DH, md.NIB_DS, md.NIB_MH, md.NIB_MS), matrix.arrays[:6]))
        assert words[md.KIND] == md.NIB and list(words[[md.HIGH, md.PER, md.MODE]]) == [*matrix.arrays[6:8],
                                                                                       matrix.arrays[8]]
    for word, array in at.items():
        assert words[word] == array.ctypes.data
        assert tuple(words[word + 1:word + 1 + array.ndim]) == array.shape
        assert not words[word + 1 + array.ndim:word + md.WORDS_AN_ARRAY].any()


def packed_arrays(matrix) -> list[np.ndarray]:
    """The arrays a packed matrix holds (its format's placeholders left out)."""
    return [a for a in matrix.arrays if isinstance(a, np.ndarray) and all(a is not p for p in PLACEHOLDERS)]


def assert_aligned_with_padding_only(arrays: list[np.ndarray]) -> None:
    for array in arrays:
        assert array.ctypes.data % ALIGN == 0 and array.flags.c_contiguous and array.flags.writeable
        assert 0 <= array.base.nbytes - array.nbytes < ALIGN  # the buffer: the array and its padding, no more


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_packed_arrays_start_on_a_cache_line(kind):
    n_in = FORMATS[kind][3] * 2
    matrix = pack(kind, random_blocks(kind, 70, n_in, np.random.default_rng(int(kind))), n_in)
    assert_aligned_with_padding_only(packed_arrays(matrix))
    with pytest.raises(ValueError, match="C-contiguous"):
        md.describe(matrix.fmt, (matrix.arrays[0][:, ::2], *matrix.arrays[1:]), n_in)


def test_every_packed_array_of_a_loaded_model_starts_on_a_cache_line(smollm2):  # noqa: F811
    """SmolLM2's 121 packed matrices: every array 64-byte aligned (np.empty's had left 92 of the 121 code arrays 16,
    32 or 48 bytes into a line), each allocated with fewer than ALIGN bytes more than it holds."""
    matrices, seen = [], set()
    for item in [smollm2.weights.embedding, smollm2.weights.output_t, *[getattr(layer, name) for layer in
                 smollm2.weights.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]]:
        for part in getattr(item, "parts", None) or [getattr(item, "matrix", item)]:
            if isinstance(part, QuantMatrix) and id(part) not in seen:
                seen.add(id(part))
                matrices.append(part)
    arrays = [a for m in matrices for a in packed_arrays(m)]
    assert len(matrices) == 121 and len(arrays) == 362
    assert_aligned_with_padding_only(arrays)
    assert sum(a.base.nbytes - a.nbytes for a in arrays) < ALIGN * len(arrays) < 1e-3 * sum(a.nbytes for a in arrays)

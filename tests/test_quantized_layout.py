"""A packed matrix as the kernels see it (model/quantized.py, model/matrix_descriptor.py): its descriptor's words
name its arrays' addresses and shapes."""

from __future__ import annotations

import numpy as np
import pytest
from test_weight_kernels import random_blocks

from pagevis.model import matrix_descriptor as md
from pagevis.model.quantized import FORMATS, pack

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

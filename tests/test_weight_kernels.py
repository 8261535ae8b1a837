"""Every packed-weight kernel equals dequantise-then-float64 matmul, with gguf-py's dequantiser as the independent
reference, within float32 rounding: for each ggml type, over shapes that leave a partial row tile, for one row
(the matrix-vector kernel), a few (the small-batch kernel) and many (dequantise-then-sgemm), on one thread and two.

The blocks are random bytes (any code is a valid weight) with sane float16 scales. The bound: the products are
summed in float32 in groups, then across groups, so each output is within (terms summed in a chain + slack) * eps
of the exact value times the sum of |terms|; the terms of the factored decode sum (d * sum q x + m * sum x) are
bounded by the group's largest |weight| (4x: the offset may exceed it). Compiling the kernels the first time
takes ~15-25 s on a 2-core machine (numba's on-disk cache holds them after that: ~1 s to load).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagevis.model import weight_threads
from pagevis.model.quant_weights import QuantStack
from pagevis.model.quantized import FORMATS, SMALL_BATCH, pack

EPS = np.finfo(np.float32).eps
# the byte offsets of each type's float16 scales within its block
SCALE_BYTES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(kind: Q, rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks whose float16 scales are in [0.001, 0.1] (the min of *_1: +-)."""
    _, _, block_bytes, block_weights = FORMATS[kind]
    blocks = rng.integers(0, 256, (rows * (n_in // block_weights), block_bytes), dtype=np.uint8)
    for at in SCALE_BYTES[kind]:
        scale = rng.uniform(0.001, 0.1, len(blocks)) * (rng.choice([-1, 1], len(blocks)) if at == 2 else 1)
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def bound(w: np.ndarray, x: np.ndarray, group: int) -> np.ndarray:
    """Per output (rows of x by rows of w): the float32 rounding bound described above."""
    n_in = w.shape[1]
    magnitude = np.repeat(np.abs(w).reshape(len(w), -1, group).max(axis=-1), group, axis=1) * 4
    return (n_in // group + group + 8) * EPS * (np.abs(x) @ magnitude.T)


CASES = [(kind, rows, blocks) for kind in FORMATS for rows, blocks in ((1, 1), (64, 2), (130, 3))]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind, rows, blocks", CASES, ids=[f"{k.name}-{r}x{b}" for k, r, b in CASES])
def test_products_equal_the_float64_product_of_gguf_dequantised_weights(kind, rows, blocks, threads, monkeypatch):
    monkeypatch.setattr(weight_threads, "MIN_SPLIT_BYTES", 0)  # small matrices split too
    weight_threads.set_weight_threads(threads)
    try:
        rng = np.random.default_rng(rows * 7 + blocks)
        n_in = FORMATS[kind][3] * blocks
        raw = random_blocks(kind, rows, n_in, rng)
        w = dequantize(raw, kind).reshape(rows, n_in).astype(np.float64)
        matrix = pack(kind, raw, n_in)
        assert matrix.shape == (n_in, rows)
        # matrix-vector; small batch (3, 8 and 16 rows: a batched decode step); dequantise-then-sgemm
        for m in (1, 3, 8, SMALL_BATCH, SMALL_BATCH + 1):
            x = rng.standard_normal((m, n_in)).astype(np.float32)
            got = x @ matrix
            assert got.shape == (m, rows) and got.dtype == np.float32
            error = np.abs(got - x.astype(np.float64) @ w.T)
            assert (error <= bound(w, x.astype(np.float64), FORMATS[kind][1])).all(), (m, error.max())
        vector = rng.standard_normal(n_in).astype(np.float32)
        np.testing.assert_array_equal(vector @ matrix, (vector[None] @ matrix)[0])
        picked = [0, rows - 1, rows // 2]
        np.testing.assert_array_equal(matrix.rows(picked), w[picked].astype(np.float32))
    finally:
        weight_threads.set_weight_threads(1)


def test_a_stack_of_types_is_its_parts_side_by_side():
    rng = np.random.default_rng(5)
    parts = [pack(kind, random_blocks(kind, 70, 256, rng), 256) for kind in (Q.Q5_0, Q.Q8_0)]
    stack = QuantStack(parts)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    assert stack.shape == (256, 140)
    np.testing.assert_array_equal(x @ stack, np.concatenate([x @ parts[0], x @ parts[1]], axis=1))


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="Q4_0 rows of 48 weights"):
        pack(Q.Q4_0, np.zeros((4, 18), np.uint8), 48)

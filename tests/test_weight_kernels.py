"""Every packed-weight kernel equals dequantise-then-float64 matmul, with gguf-py's dequantiser as the independent
reference, within float32 rounding: for each ggml type, over shapes that leave a partial row tile, for one row
(the matrix-vector kernel), a few (the small-batch kernel) and many (dequantise-then-sgemm), on one thread and two.

The blocks are random bytes (any code is a valid weight) with sane float16 scales (edge scales: their own test).
The bound: the products are summed in float32 in groups, then across groups, so each output is within (terms
summed in a chain + slack) * eps of the exact value times the sum of |terms|; the terms of the factored decode sum
(d * sum q x + m * sum x) are bounded by the group's largest |weight| (4x: the offset may exceed it). Compiling the
kernels the first time takes ~25 s on an idle 2-core machine (numba's on-disk cache holds them after that: ~1 s).
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


# float16 bit patterns at the edges: zero and minus zero, the smallest and largest subnormals, the smallest normal,
# one, negative ones, the largest half (65504) and its negative
EDGE_HALVES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x3C00, 0xBC00, 0xB555, 0x7BFF, 0xFBFF],
                       np.uint16)


def test_the_kernels_float16_conversion_is_numpys_on_every_finite_half():
    from pagevis.model.weight_kernels import halves_to_float32

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]  # every finite half (the scales holding inf or NaN are refused)
    got = np.empty(len(finite), np.float32)
    halves_to_float32(finite.view(np.int16), got)
    expected = finite.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit: -0 stays -0
    at_edges = np.empty(len(EDGE_HALVES), np.float32)
    halves_to_float32(EDGE_HALVES.view(np.int16), at_edges)
    assert at_edges.tolist()[:4] == [0.0, -0.0, 2.0 ** -24, 1023 * 2.0 ** -24]
    assert at_edges.tolist()[-2:] == [65504.0, -65504.0]


@pytest.mark.parametrize("kind", list(FORMATS), ids=[k.name for k in FORMATS])
def test_weights_with_edge_scales_are_gguf_pys_bit_for_bit(kind):
    """Scales of zero, subnormal, negative and the largest halves (Q4_0's m = -8d at 65504 too): the packed
    weights, dequantised by the kernels, are gguf-py's dequantised weights exactly, and a product stays in bound."""
    rng = np.random.default_rng(11)
    rows, n_in = 70, FORMATS[kind][3] * 2
    raw = random_blocks(kind, rows, n_in, rng)
    blocks = raw.reshape(-1, FORMATS[kind][2])
    for at in SCALE_BYTES[kind]:
        blocks[:, at:at + 2] = rng.choice(EDGE_HALVES, len(blocks)).view(np.uint8).reshape(-1, 2)
    w = dequantize(raw, kind).reshape(rows, n_in)
    matrix = pack(kind, raw, n_in)
    np.testing.assert_array_equal(matrix.dequantize()[:, :rows].T, w)
    np.testing.assert_array_equal(matrix.rows(np.arange(rows)), w)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    error = np.abs((x @ matrix) - x.astype(np.float64) @ w.T.astype(np.float64))
    assert (error <= bound(w.astype(np.float64), x.astype(np.float64), FORMATS[kind][1])).all()


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=lambda k: k.name)
def test_a_scale_that_is_infinite_or_nan_is_refused(kind):
    rng = np.random.default_rng(2)
    raw = random_blocks(kind, 64, FORMATS[kind][3], rng)
    raw[5, SCALE_BYTES[kind][-1]:SCALE_BYTES[kind][-1] + 2] = np.array([0x7E00], np.uint16).view(np.uint8)  # NaN
    with pytest.raises(ValueError, match="infinite or NaN"):
        pack(kind, raw, FORMATS[kind][3])


# bits a weight held: codes, and per group (or K types' super-block) float16 scales and 8-bit sub-scales
HELD_BITS = {Q.Q4_0: 4.5, Q.Q4_1: 5.0, Q.Q5_1: 6.0, Q.Q8_0: 8.5, Q.Q5_0: 8.5, Q.Q4_K: 4 + 16 / 32 + 32 / 256,
             Q.Q5_K: 5 + 16 / 32 + 32 / 256, Q.Q6_K: 8 + 8 / 16 + 16 / 256}


@pytest.mark.parametrize("kind", list(FORMATS), ids=[k.name for k in FORMATS])
def test_the_bytes_held_are_the_files_where_the_format_keeps_its_bits(kind):
    rng = np.random.default_rng(3)
    raw = random_blocks(kind, 128, FORMATS[kind][3] * 2, rng)
    matrix = pack(kind, raw, FORMATS[kind][3] * 2)
    assert matrix.nbytes * 8 == HELD_BITS[kind] * raw.size // FORMATS[kind][2] * FORMATS[kind][3]
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q8_0):
        assert matrix.nbytes == raw.nbytes == matrix.file_bytes


def test_parts_are_packed_as_their_rows_one_after_another(tmp_path):
    """Q, K, V packed as one matrix without concatenating them (a part ending inside a row tile), straight from a
    read-only file mapping, whose pages the repacking drops as it goes: the same as packing their concatenation
    in memory, and the mapping still reads the file's bytes afterwards."""
    from pagevis.model import quantized

    rng = np.random.default_rng(4)
    parts = [random_blocks(Q.Q4_K, rows, 512, rng) for rows in (70, 60, 200)]
    path = tmp_path / "rows.bin"
    np.concatenate(parts).tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r").reshape(330, -1)
    views = [mapped[:70], mapped[70:130], mapped[130:]]
    old_rows, quantized.REPACK_ROWS = quantized.REPACK_ROWS, 64  # several chunks, each dropped once repacked
    try:
        matrix = pack(Q.Q4_K, views, 512)
    finally:
        quantized.REPACK_ROWS = old_rows
    whole = pack(Q.Q4_K, np.concatenate(parts), 512)
    np.testing.assert_array_equal(matrix.dequantize(), whole.dequantize())
    np.testing.assert_array_equal(mapped, np.concatenate(parts))
    assert matrix.shape == (512, 330) and matrix.file_bytes == mapped.nbytes


def test_a_second_process_waits_for_the_one_compiling_the_kernels():
    """Loading the kernels takes the cache folder's lock: while another process holds it (compiling), a starting
    process waits, then loads them once it is released."""
    import fcntl
    import subprocess
    import sys
    import time

    from pagevis.kernel_loader import cache_dir, lock_name

    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / lock_name("pagevis.model.weight_kernels"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a process compiling them would
        loader = subprocess.Popen([sys.executable, "-c", "from pagevis.model.quantized import kernels; kernels()"])
        try:
            time.sleep(3)
            assert loader.poll() is None, "the kernels were loaded while another process held their lock"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert loader.wait(timeout=120) == 0

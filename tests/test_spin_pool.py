"""The weights' second thread (model/spin_pool.py): a product shared with the helper equals the one-thread kernel's bit
for bit on every packed type and size, one row or a prefill's rows, whichever thread computes which chunk (the helper's
from its scratch buffer, a chunk it stalled on computed again by the caller, which then never waits long); two
callers at once stay exact; a process using it never hangs, its helper parks when idle (no CPU) and the process
exits cleanly (bounded, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pagevis.model import quantized, weight_threads
from pagevis.model.quantized import FORMATS, TILE, kernels, pack
from tests.test_weight_kernels import random_blocks

# rows: 1 tile (never cut), 3 (cut in two), 10 and 41 with a partial last tile (2 and 5 chunks)
SHAPES = [(64, 2), (130, 3), (9 * 64 + 5, 2), (41 * 64 - 7, 4)]


def matrices(kind: Q, rng: np.random.Generator):
    for rows, blocks in SHAPES:
        n_in = blocks * FORMATS[kind][3]
        yield pack(kind, random_blocks(kind, rows, n_in, rng), n_in), rng.standard_normal(n_in).astype(np.float32)


def one_thread(matrix, x) -> np.ndarray:
    out = np.empty(matrix.tiles * TILE, np.float32)
    kernels()[matrix.fmt](*matrix.arrays, x, 0, matrix.tiles, out)
    return out


@pytest.fixture
def pool_module():
    weight_threads.set_weight_threads(2)
    assert quantized.spin_pool() is not None  # compiled, or loaded from numba's cache
    from pagevis.model import spin_pool

    yield spin_pool
    weight_threads.set_weight_threads(1)


def idle_control(spin_pool) -> np.ndarray:
    """A control array no helper thread serves: the test plays the helper."""
    return spin_pool.new_control()


@pytest.mark.parametrize("kind", list(FORMATS), ids=lambda k: k.name)
def test_two_threads_equal_one_bit_for_bit(kind, pool_module):
    rng = np.random.default_rng(int(kind))
    for matrix, x in matrices(kind, rng):
        for _ in range(3):  # the chunks fall to either thread differently each time
            two = matrix.product(x)
            assert np.array_equal(two.view(np.int32), one_thread(matrix, x)[:matrix.n_out].view(np.int32))


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_the_helpers_chunks_come_from_its_scratch(kind, pool_module):
    """The helper takes every chunk (the test thread plays it before the caller runs): the caller copies them all
    from the scratch buffer, bit for bit one thread's."""
    sp, rng = pool_module, np.random.default_rng(7)
    for matrix, x in list(matrices(kind, rng))[1:]:
        ctrl, scratch = idle_control(sp), np.full(matrix.tiles * TILE, np.nan, np.float32)
        out = np.full(matrix.tiles * TILE, np.nan, np.float32)
        count = sp.post(ctrl, matrix.descriptor, 5, x, scratch, matrix.row_address)
        assert count >= 2
        sp.help_job(ctrl, int(ctrl[sp.NEXT]))
        assert ctrl[sp.HELPED] == count and ctrl[sp.HELPER_SEQ] == -1
        sp.run(ctrl, 5, count, out, scratch)
        assert np.array_equal(out.view(np.int32), one_thread(matrix, x).view(np.int32))


def test_a_chunk_the_helper_stalls_on_is_computed_by_the_caller(pool_module):
    """The helper claimed chunk 0 and never finished it (its core went elsewhere): the caller computes it itself
    after about a chunk's time, not waiting for the helper."""
    sp, rng = pool_module, np.random.default_rng(3)
    matrix, x = list(matrices(Q.Q4_1, rng))[-1]
    ctrl, scratch = idle_control(sp), np.zeros(matrix.tiles * TILE, np.float32)
    out = np.full(matrix.tiles * TILE, np.nan, np.float32)
    count = sp.post(ctrl, matrix.descriptor, 9, x, scratch, matrix.row_address)
    ctrl[sp.NEXT] += 1  # the helper's claim of chunk 0, its result never marked done
    started = time.perf_counter()
    sp.run(ctrl, 9, count, out, scratch)
    assert time.perf_counter() - started < 0.5
    assert ctrl[sp.TAKEN_OVER] == 1 and ctrl[sp.HELPED] == 0
    assert np.array_equal(out.view(np.int32), one_thread(matrix, x).view(np.int32))


ROW_KINDS = [kind for kind in FORMATS if FORMATS[kind][0] in quantized.POOL_ROWS]


def one_thread_rows(matrix, x) -> np.ndarray:
    """A prefill's product on one thread (batch_kernels' kernel, PREFILL_ROWS rows at a time)."""
    weight_threads.set_weight_threads(1)
    try:
        return matrix.product(x)
    finally:
        weight_threads.set_weight_threads(2)


@pytest.mark.parametrize("kind", ROW_KINDS, ids=lambda k: k.name)
def test_a_prefills_rows_on_two_threads_equal_one_thread_bit_for_bit(kind, pool_module):
    """More than SMALL_BATCH rows (a prefill) go through the spin pool (product_rows): one job or two, a last
    64-row block short or not."""
    rng = np.random.default_rng(int(kind) + 100)
    for (matrix, _), n in zip(matrices(kind, rng), (17, 64, 100, 300), strict=True):
        x = rng.standard_normal((n, matrix.n_in)).astype(np.float32)
        expected = one_thread_rows(matrix, x)
        for _ in range(3):
            assert np.array_equal(matrix.product(x).view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda k: k.name)
def test_the_helpers_row_chunks_come_from_its_scratch_and_a_stalled_one_is_taken_back(kind, pool_module):
    """A block of rows: the helper takes every chunk (the test thread plays it) and the caller copies them from the
    scratch, laid out as the output's rows; then a chunk the helper claims and never finishes the caller computes."""
    sp, rng = pool_module, np.random.default_rng(5)
    matrix = list(matrices(kind, rng))[-1][0]
    x = rng.standard_normal((quantized.PREFILL_ROWS, matrix.n_in)).astype(np.float32)
    expected = one_thread_rows(matrix, x)
    stride = matrix.tiles * TILE
    for stalled in (False, True):
        ctrl, scratch = idle_control(sp), np.full(len(x) * stride, np.nan, np.float32)
        out = np.full(len(x) * stride, np.nan, np.float32)
        count = sp.post_rows(ctrl, matrix.descriptor, 5, x, stride, scratch, matrix.rows_address)
        assert count >= 2
        if stalled:
            ctrl[sp.NEXT] += 1  # the helper's claim of chunk 0, its result never marked done
        else:
            sp.help_job(ctrl, int(ctrl[sp.NEXT]))
            assert ctrl[sp.HELPED] == count
        sp.run(ctrl, 5, count, out, scratch)
        assert ctrl[sp.TAKEN_OVER] == int(stalled)
        assert np.array_equal(out.reshape(len(x), stride)[:, :matrix.n_out].view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("stalled", [False, True])
def test_a_chunk_the_helper_finished_is_copied_in_between_the_callers_own(stalled, pool_module):
    """The helper finished chunk 0 (stalled: and claimed chunk 1, never finishing it) before the caller runs: the
    caller copies chunk 0 from the scratch, laid out as the output's rows, after its first own chunk (its values, not
    the caller's: marked), and takes chunk 1 back; every other chunk bit for bit one thread's."""
    sp, rng = pool_module, np.random.default_rng(13)
    matrix = list(matrices(Q.Q4_K, rng))[-1][0]
    x = rng.standard_normal((quantized.PREFILL_ROWS, matrix.n_in)).astype(np.float32)
    expected = one_thread_rows(matrix, x)
    stride = matrix.tiles * TILE
    ctrl, scratch = idle_control(sp), np.full((len(x), stride), np.nan, np.float32)
    out = np.full(len(x) * stride, np.nan, np.float32)
    count = sp.post_rows(ctrl, matrix.descriptor, 5, x, stride, scratch.reshape(-1), matrix.rows_address)
    width = int(ctrl[sp.CHUNK]) * TILE
    assert count >= 3 and width < matrix.n_out
    scratch[:, :width] = expected[:, :width] + 1  # the helper's chunk 0, told apart from the caller's
    ctrl[sp.STATE] = (5 << 2) | sp.DONE
    ctrl[sp.NEXT] += 1 + int(stalled)
    sp.run(ctrl, 5, count, out, scratch.reshape(-1))
    assert ctrl[sp.TAKEN_OVER] == int(stalled)
    got = out.reshape(len(x), stride)[:, :matrix.n_out]
    assert np.array_equal(got[:, :width], expected[:, :width] + 1)
    assert np.array_equal(got[:, width:].view(np.int32), expected[:, width:].view(np.int32))


def test_two_callers_at_once_stay_exact(pool_module):
    rng = np.random.default_rng(11)
    pairs = list(matrices(Q.Q4_1, rng)) + list(matrices(Q.Q8_0, rng))
    expected = [one_thread(m, x)[:m.n_out] for m, x in pairs]
    wrong: list[int] = []

    def caller():
        for _ in range(50):
            for i, (m, x) in enumerate(pairs):
                if not np.array_equal(m.product(x), expected[i]):
                    wrong.append(i)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not wrong and not any(thread.is_alive() for thread in threads)


SCRIPT = """
import os, time
import numpy as np
from gguf import GGMLQuantizationType as Q
from pagevis.model import quantized, weight_threads
from pagevis.model import quantized
from pagevis.model.quantized import pack, TILE, kernels
from tests.test_weight_kernels import random_blocks
weight_threads.set_weight_threads(2)
rng = np.random.default_rng(0)
matrix = pack(Q.Q8_0, random_blocks(Q.Q8_0, 48 * 64, 256, rng), 256)
x = rng.standard_normal(256).astype(np.float32)
expected = np.empty(matrix.tiles * TILE, np.float32)
kernels()["i8"](*matrix.arrays, x, 0, matrix.tiles, expected)
for _ in range(1000):
    assert np.array_equal(matrix.product(x), expected)
pool = quantized.spin_pool()
from pagevis.model import spin_pool
deadline = time.monotonic() + 5
while not pool.ctrl[spin_pool.PARKED] and time.monotonic() < deadline:
    time.sleep(0.05)
cpu = time.process_time()
time.sleep(0.5)
print("parked", int(pool.ctrl[spin_pool.PARKED]), "idle_cpu", time.process_time() - cpu, flush=True)
assert np.array_equal(matrix.product(x), expected)  # woken (or computed alone while it wakes)
"""


def test_the_helper_never_hangs_parks_when_idle_and_exits_with_the_process():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    words = done.stdout.split()
    assert words[:2] == ["parked", "1"], done.stdout
    assert float(words[3]) < 0.1  # a parked helper takes no CPU (a spinning one would take ~0.5 s here)
    assert time.monotonic() - started < 300

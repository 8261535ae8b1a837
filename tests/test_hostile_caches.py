"""numba's cache of the quantized-weight kernels, as a tester finds it (issue #44): damaged files (a garbage .nbi, a
truncated .nbc) were an unpickling traceback; no writable cache folder (a read-only install with a read-only cache
home) was "cannot cache function ... no locator available"; a compile lock held by a live process made every launch
wait forever, saying "compiling"; and "compiling" was said whenever pagevis's own folder was new. Now each falls
back to compiling (healing the damaged files, or in memory) with one line on stderr, the lock is waited for 15 s at
most, and "compiling" is said only when numba compiles. Each case compiles the kernels (~25 s, longer on a busy
machine) in its own process: slow tests, but the first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A product through the loaded kernels, checked against gguf-py's dequantiser: the fallback's kernels are kernels.
CHECK = """
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from pagevis.model.quantized import pack
weights = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
raw = quantize(weights, Q.Q8_0)
x = np.ones(64, np.float32)
assert np.allclose(x @ pack(Q.Q8_0, raw, 64), dequantize(raw, Q.Q8_0) @ x, atol=1e-3)
"""


def load_kernels(env: dict, before: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    code = f"{before}\nfrom pagevis.model.quantized import kernels\nkernels()\n{CHECK}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **env})


def test_loading_cached_kernels_says_nothing():
    load_kernels({})  # compiles them if this checkout's cache is cold (then it may say so)
    again = load_kernels({})
    assert again.returncode == 0 and again.stderr == "", again.stderr


@pytest.mark.slow
def test_damaged_cache_files_are_compiled_again_and_healed(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PAGEVIS_CACHE_DIR": str(tmp_path / "pagevis")}
    first = load_kernels(env)
    assert first.returncode == 0 and first.stderr.count("pagevis: compiling the quantized-weight kernels") == 1
    # a kernel the module's import loads, and one compiled on demand (the Q8_0 matrix-vector kernel, a C function)
    index = sorted((tmp_path / "numba").rglob("weight_kernels._group_sums-*.nbi"))
    data = sorted((tmp_path / "numba").rglob("batch_kernels._row_kernel*i8_row-*.nbc"))
    assert index and data
    index[0].write_bytes(b"garbage")
    data[0].write_bytes(data[0].read_bytes()[:100])
    damaged = load_kernels(env)
    assert damaged.returncode == 0, damaged.stderr
    lines = damaged.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert ("numba's cache of the quantized-weight kernels (pagevis.model.weight_kernels) cannot be used") in lines[0]
    assert ("numba's cache of the weights' matrix-vector kernel (i8) (pagevis.model.batch_kernels) cannot be "
            "used") in lines[1]
    healed = load_kernels(env)
    assert healed.returncode == 0 and healed.stderr == "", healed.stderr


@pytest.mark.slow
def test_no_writable_cache_folder_compiles_in_memory_with_one_line(tmp_path):
    """As root every folder is writable: numba's locators are told the folder cannot be made, as a read-only install
    with a read-only cache home tells them."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PAGEVIS_CACHE_DIR": str(tmp_path / "pagevis")}
    before = ("from numba.core import caching\n"
              "def refuse(self):\n    raise PermissionError('read-only')\n"
              "caching._CacheLocator.ensure_cache_path = refuse\n")
    done = load_kernels(env, before)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no locator available" in lines[0] and "Traceback" not in done.stderr
    assert not list((tmp_path / "numba").rglob("*.nbi"))


@pytest.mark.slow
def test_a_held_compile_lock_is_waited_for_a_bounded_time(tmp_path):
    import fcntl

    from pagevis.kernel_loader import lock_name  # (the subprocess's: the same checkout and NUMBA_CACHE_DIR)

    env = {"PAGEVIS_CACHE_DIR": str(tmp_path / "pagevis")}
    (tmp_path / "pagevis").mkdir()
    with open(tmp_path / "pagevis" / lock_name("pagevis.model.weight_kernels"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a live process that never lets go
        done = load_kernels(env, "import pagevis.kernel_loader as loader\nloader.LOCK_WAIT = 1.0\n")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has held the kernels' compile lock for 1 s; compiling them in memory" in lines[0]

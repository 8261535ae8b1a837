"""Memory handed back once it is no longer used: numba's and LLVM's code pages after the kernels are linked are paged
out of this process (the ones only it maps), and the kernels still compute what they did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagevis.model.quantized import pack
from pagevis.model.resident import COMPILER_PACKAGES, _package_folders, release_compiler_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_PAGEOUT is Linux's (5.4+)")


def _compiler_pages() -> tuple[int, int]:
    """(private, all) resident bytes of this process's read-only mappings of numba's and llvmlite's files."""
    folders, private, resident, counting = _package_folders(COMPILER_PACKAGES), 0, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a mapping's header line
                counting = len(fields) == 6 and "w" not in fields[1] and fields[5].startswith(folders)
            elif counting and fields[0] in ("Private_Clean:", "Private_Dirty:"):
                private += int(fields[1]) << 10
            elif counting and fields[0] == "Rss:":
                resident += int(fields[1]) << 10
    return private, resident


PROBE = """
import json
from tests.test_resident import _compiler_pages
from pagevis.kernel_loader import import_kernels
import_kernels("pagevis.model.weight_kernels", "the weight kernels")  # loaded and linked as the app does (its CPU
# features: a plain import compiled them again for LLVM's default ones, 18 s of a clean clone here); nothing released
from pagevis.model.resident import release_compiler_pages, release_linking_modules
release_linking_modules()  # (which release_compiler_pages does first: its bitcode writer's pages in before)
before = _compiler_pages()
advised = release_compiler_pages()
print(json.dumps([before, advised, _compiler_pages()]))
"""


def test_the_compilers_pages_are_paged_out():
    """In a fresh process (its own pages): of the pages only it maps, what stays is the relocated (dirty, so not
    file) pages, ~2 MiB; pages the test process maps too are left to it by the kernel."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    (private_before, resident_before), advised, (private_after, resident_after) = json.loads(done.stdout)
    assert resident_before > 20 << 20 and advised > resident_before  # the mappings were found and advised
    assert private_after <= min(private_before, 4 << 20), (private_before, private_after)
    assert resident_after <= resident_before - (private_before - private_after)


def test_the_kernels_compute_after_the_pages_are_released():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (64, 2 * 34), dtype=np.uint8)  # 64 rows of two Q8_0 blocks
    raw[:, 0:2] = raw[:, 34:36] = np.array([0.01], np.float16).view(np.uint8)
    matrix = pack(Q.Q8_0, raw, 64)  # loads the kernels, which releases the pages
    release_compiler_pages()
    x = rng.standard_normal(64).astype(np.float32)
    want = dequantize(raw, Q.Q8_0).reshape(64, 64).astype(np.float64) @ x
    np.testing.assert_allclose(x @ matrix, want, rtol=1e-5, atol=1e-5)

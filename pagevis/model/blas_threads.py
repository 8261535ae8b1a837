"""Setting how many threads NumPy's OpenBLAS uses, after NumPy is loaded.

Decoding is memory-bound, so a second BLAS thread gains little (~1.15x on an idle 2-core
machine), while OpenBLAS threads that spin-wait for a core that is busy (the GUI, another
process) make a decode step several times slower (measured: 1.0 vs 11.3 tokens/s for SmolLM2
with one core kept busy). The app should therefore call set_blas_threads(1).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np  # noqa: F401  (loads OpenBLAS, so it is in the process maps below)

# Names of the setter in plain OpenBLAS builds and in the scipy-openblas build NumPy wheels ship.
SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads64_", "openblas_set_num_threads")


def set_blas_threads(count: int) -> bool:
    """Ask every loaded OpenBLAS to use count threads; False if none could be found (not Linux,
    or NumPy built on another BLAS). Environment variables cannot do this once NumPy is imported."""
    done = False
    for handle in _loaded_openblas():
        for name in SETTERS:
            setter = getattr(handle, name, None)
            if setter is not None:
                setter(ctypes.c_int(count))
                done = True
                break
    return done


def blas_description() -> str:
    """The loaded OpenBLAS build (its config string) and thread count, or "unknown BLAS"."""
    for handle in _loaded_openblas():
        parts = []
        for prefix in ("scipy_openblas_", "scipy_openblas", "openblas_"):
            config = getattr(handle, f"{prefix}get_config64_", None) or getattr(handle, f"{prefix}get_config", None)
            threads = (getattr(handle, f"{prefix}get_num_threads64_", None)
                       or getattr(handle, f"{prefix}get_num_threads", None))
            if config is not None and threads is not None:
                config.restype = ctypes.c_char_p
                parts = [config().decode(errors="replace"), f"{threads()} threads"]
                break
        if parts:
            return ", ".join(parts)
    return "unknown BLAS"


def _loaded_openblas() -> Iterator[ctypes.CDLL]:
    """Every OpenBLAS library loaded in this process (from /proc/self/maps: none elsewhere), opened."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return
    for library in sorted(set(re.findall(r"(/\S*openblas\S*\.so[\w.]*)", maps.read_text()))):
        try:
            yield ctypes.CDLL(library)
        except OSError:
            continue

"""Stale kernels dropped: numba's on-disk cache checks only the source file of the function it compiled (its
modification time and size), but pagevis's kernels inline and link one another's code across modules (the weights'
matrix-vector kernels into the spin pool's and the int8 rows', kernel_intrinsics.py and tile_sums.py into most).
After a change to one of those modules (a `git pull`, a new release over an old checkout), the unchanged modules'
cache entries would keep running the old code, or call a kernel whose arguments changed.

So the kernels' sources are fingerprinted (every module of pagevis that uses numba), and the fingerprint of the
sources the cache was compiled from is kept beside the cache (`record()`). When they differ, the numba cache files of
every such module are removed before the first kernel of a process loads (kernel_loader), and numba compiles them all
again (~1-3 minutes here). Built on nothing of pagevis, and imports no numba.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def kernel_sources() -> list[Path]:
    """pagevis's modules whose code numba compiles or inlines (those that mention numba), in a fixed order."""
    return sorted(path for path in PACKAGE.rglob("*.py") if b"numba" in path.read_bytes())


def fingerprint(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def numba_cache_files(sources: list[Path]) -> Iterator[Path]:
    """The numba cache files (index .nbi, data .nbc) of these modules where numba keeps them: under NUMBA_CACHE_DIR
    when it is set (numba then uses no other folder, and `record()` lies there too: a checkout's own cache is not
    this one's to drop), else beside them (__pycache__), or in numba's per-user folder where the package's own is not
    writable. numba names each '<module stem>.<function>-<line>.py<version>.nb[ic]'."""
    stems = tuple(f"{path.stem}." for path in sources)
    homes = {path.parent for path in sources}
    if os.environ.get("NUMBA_CACHE_DIR"):
        folders = {Path(os.environ["NUMBA_CACHE_DIR"]) / numba_folder_name(home) for home in homes}
    else:
        user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
        folders = {home / "__pycache__" for home in homes} | {user_cache / numba_folder_name(home) for home in homes}
    for folder in folders:
        if folder.is_dir():
            for file in folder.iterdir():
                if file.suffix in (".nbi", ".nbc") and file.name.startswith(stems):
                    yield file


def numba_folder_name(home: Path) -> str:
    """The folder numba keeps a source folder's cache in under NUMBA_CACHE_DIR or its per-user cache: the folder's
    name and the SHA-1 of its absolute path (numba.core.caching._CacheLocator.get_suitable_cache_subpath; the path
    a module was imported by, which is this package's resolved one unless it was imported through a symlink)."""
    path = os.path.abspath(home)
    return f"{os.path.basename(path)}_{hashlib.sha1(path.encode()).hexdigest()}"


def record() -> Path:
    """Where the fingerprint of the sources the cache holds is kept: beside numba's cache of the package (its
    __pycache__, or NUMBA_CACHE_DIR), so each checkout, install and numba cache has its own."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "pagevis-kernel-sources.sha256"
    return PACKAGE / "__pycache__" / "kernel-sources.sha256"


def drop_stale_kernels() -> bool:
    """Remove the kernels' numba cache files when the sources differ from those `record()` says they were
    compiled from, then record the sources' fingerprint; whether anything was dropped. A folder that cannot be
    written leaves things as they are (numba's own checks still hold for the modules that changed)."""
    sources, record_file = kernel_sources(), record()
    now = fingerprint(sources)
    try:
        if record_file.exists() and record_file.read_text() == now:
            return False
        dropped = False
        for file in numba_cache_files(sources):
            file.unlink(missing_ok=True)
            dropped = True
        record_file.parent.mkdir(parents=True, exist_ok=True)
        record_file.write_text(now)
        return dropped
    except OSError:
        return False

"""Handing memory the process no longer uses back to the system, so that it does not count in the resident set.

Four kinds, each after the step that left it behind: the heap a build freed in small blocks (glibc keeps them for
reuse), pages of the model file's read-only mapping once what they hold is repacked or read, and once kernels are
loaded the code pages of numba's compiler and LLVM and the IR numba keeps parsed beside each kernel (decoding runs
only the kernels' machine code; the compiler is not executed again)."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import sys
from pathlib import Path

COMPILER_PACKAGES = ("llvmlite", "numba")
# Linux's MADV_PAGEOUT (5.4+), which Python's mmap names only when it was built against headers that have it
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform == "linux" else None)


def release_freed_heap() -> None:
    """Give the heap the tokenizer build freed back to the system (glibc's malloc_trim; elsewhere nothing).

    Building the tokenizer frees ~100 MiB for Gemma (the vocabulary dict and merges handed to the tokenizers library,
    its own transient copies) in small blocks that glibc keeps for reuse: they stay in the resident set. The weights
    that load next come in large blocks or file mappings that do not reuse them, so without the trim they stack on top
    of the freed transient and the peak RSS counts both."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (no malloc_trim), or no C library to name
        pass


def release_mapped(mapped: mmap.mmap, start: int, end: int) -> None:
    """Drop bytes start..end of a read-only file mapping from the process (MADV_DONTNEED; start page-aligned, the
    kernel rounds the end up to a page): they stay in the page cache, and come back if read again. Only ever on a
    read-only file mapping: on anything else (a private copy, the heap) it would lose data."""
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def release_whole_pages(mapped: mmap.mmap, start: int, end: int) -> None:
    """release_mapped for the pages lying wholly within bytes start..end (a neighbour's bytes stay mapped)."""
    release_mapped(mapped, -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE)


def release_compiler_pages() -> int:
    """Page out this process's read-only file mappings of numba and llvmlite (madvise MADV_PAGEOUT, Linux 5.4+);
    the bytes advised (0 where it cannot be done).

    Loading the cached kernels runs LLVM's initialisation and linker: ~65 MiB of libllvmlite's and numba's code
    pages become resident (SmolLM2's whole packed weights are 97 MB) and would stay so, unused, for the life of the
    process. They are clean pages of the installed files: paged out they cost nothing, and come back from the file
    if a compile ever needs them. Pages another process also maps are left to it (the kernel skips them). The
    loaded kernels' linking IR goes too (release_linking_modules)."""
    release_linking_modules()
    advice = MADV_PAGEOUT
    folders = _package_folders(COMPILER_PACKAGES)
    if advice is None or not folders:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except (OSError, AttributeError):
        return 0
    advised = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "w" in fields[1] or not fields[5].startswith(folders):
            continue
        start, end = (int(address, 16) for address in fields[0].split("-"))
        if libc.madvise(start, end - start, advice) == 0:
            advised += end - start
    return advised


def _package_folders(names: tuple[str, ...]) -> tuple[str, ...]:
    folders = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            folders.append(str(Path(location).resolve()) + "/")
    return tuple(folders)


def release_linking_modules(dispatchers=None) -> int:
    """Free the LLVM module numba keeps parsed beside each kernel it loaded or compiled, for linking the kernel into
    a later compile that calls it (CPUCodeLibrary._shared_module: its whole IR, inlined callees included); its
    bitcode is kept instead (a tenth of it: the bytes numba's cache gave for kernels loaded after the first call,
    written out for the others) and parsed again if a compile ever links it. The kernels of pagevis's modules (or
    `dispatchers`); how many were released. Measured: 18 MiB of SmolLM2's resident set with two threads (the spin
    pool's kernels inline the weight kernels: 6 MB of IR text, the weight kernels 4)."""
    try:
        import llvmlite.binding as binding
        from numba.core.codegen import CPUCodeLibrary
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return 0
    released = 0
    with global_compiler_lock:
        _keep_bitcode(CPUCodeLibrary, binding)
        for dispatcher in _kernel_dispatchers(Dispatcher) if dispatchers is None else dispatchers:
            for result in list(dispatcher.overloads.values()):
                library = getattr(result, "library", None)
                module = getattr(library, "_shared_module", None)
                if library is not None and module is not None:
                    if library.__dict__.get(BITCODE) is None:
                        setattr(library, BITCODE, module.as_bitcode())
                    library._shared_module = None
                    released += 1
    release_freed_heap()  # the IR's many small blocks (released here, or as each kernel loaded)
    return released


BITCODE = "_pagevis_bitcode"  # a library's linking module as bitcode, where release_linking_modules keeps it


def _keep_bitcode(library_class, binding) -> None:
    """Once: a library loaded from numba's cache from now on keeps the linking module's bitcode the cache gave and
    releases the module itself as soon as it is loaded, and a library whose linking module was released parses it
    again from that bitcode when numba asks for it."""
    if getattr(library_class._get_module_for_linking, "parses_released", False):
        return
    linking, unserialize = library_class._get_module_for_linking, library_class._unserialize.__func__

    def module_for_linking(self):
        if self._shared_module is None and self.__dict__.get(BITCODE) is not None:
            self._shared_module = binding.parse_bitcode(self.__dict__.pop(BITCODE))
        return linking(self)

    def unserialized(cls, codegen, state):
        library = unserialize(cls, codegen, state)
        if state[1] == "object":  # (name, kind, (object code, linking bitcode)): released at once, so that a
            setattr(library, BITCODE, state[2][1])  # module's kernels loading one after another hold one's IR at most
            library._shared_module = None
        return library

    module_for_linking.parses_released = True  # type: ignore[attr-defined]
    library_class._get_module_for_linking = module_for_linking
    library_class._unserialize = classmethod(unserialized)


def _kernel_dispatchers(dispatcher_class) -> list:
    """The numba kernels pagevis's modules hold: module globals, and the values of their small dicts, tuples and
    lists (a table of kernels by format) one or two levels down."""
    found: dict[int, object] = {}

    def visit(value, depth: int) -> None:
        if isinstance(value, dispatcher_class):
            found[id(value)] = value
        elif depth and isinstance(value, (dict, tuple, list)) and len(value) <= 64:
            for item in value.values() if isinstance(value, dict) else value:
                visit(item, depth - 1)

    for name, module in list(sys.modules.items()):
        if name.startswith("pagevis.") and module is not None:
            for value in list(vars(module).values()):
                visit(value, 2)
    return list(found.values())

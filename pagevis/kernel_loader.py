"""The one way a module of numba kernels is imported: `import_kernels(module_name, what)`, for the model's (weight,
batch, fused and spin-pool kernels) and the cache's (decode attention, batched decode, the policies' scores).

A kernel compiled with an explicit signature compiles, or loads from numba's on-disk cache, when its module is
imported (a first compile takes seconds: ~25 for the weight kernels). So the import:
- holds the compile lock: a thread lock within the process (of two threads, one imports, the other then finds the
  module) and a file lock (fcntl) in the cache folder, one a numba cache and family of kernel modules
  (`lock_name`), between processes (of two
  processes starting on a new install, the app and `pagevis serve`, a test run's subprocesses, one compiles and the
  other waits, then loads what it wrote from numba's cache, instead of both compiling). A lock another process has held for LOCK_WAIT
  seconds (one stopped while holding it would make every launch wait) is given up on: the kernels compile in memory,
  said in one line; later imports in the process then do not wait for it again (and compile in memory while it is
  still held, that line having said so).
- heals a damaged cache: numba raises on a file it cannot unpickle (a truncated .nbc, a garbage .nbi); the import is
  tried again with such files read as absent, so numba compiles the kernels and writes them again; one line on
  stderr says so and why. Where numba cannot write a cache at all (no writable folder: "no locator available"), the
  same line is said and the kernels compile in memory.
- raises KernelLoadError, naming the module and numba's reason, when even the in-memory compile fails.
"Compiling" is said on stderr when numba starts compiling (its numba:compile event fires on a cache miss only) for
the modules that take long (`seconds`); a load from the cache says nothing.

Built on nothing of pagevis, and imports numba only when loading: the model and the cache both use it
(tests/test_layering.py), and `import pagevis` must not pay for numba.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Any, TypeVar, overload



# Kernel modules that import one another's kernels (a module's import compiles those too, under its lock) share one
# lock; any other module has a lock of its own, so the attention kernels a test needs never wait for another process
# compiling the weights' (tests/test_kernel_loader.py checks no kernel module imports another family's).
FAMILIES = {
    "weights": ("pagevis.model.weight_kernels", "pagevis.model.batch_kernels", "pagevis.model.spin_pool",
                "pagevis.model.int8_kernels"),
    "attention": ("pagevis.kvcache.decode_kernel", "pagevis.kvcache.batch_decode_kernel",
                  "pagevis.kvcache.chunk_kernel"),
}
_FAMILY_OF = {module: family for family, modules in FAMILIES.items() for module in modules}


def lock_name(module_name: str) -> str:
    """The lock file of a kernel module: one per numba cache of pagevis's kernels and family of modules (FAMILIES).
    numba keeps the kernels beside the modules (or under NUMBA_CACHE_DIR), so the processes of one install share it,
    and another checkout or install, compiling into its own cache, has its own (it waited for the others' compiles
    when the lock was one a machine)."""
    import hashlib

    where = f"{Path(__file__).resolve().parent}|{os.environ.get('NUMBA_CACHE_DIR', '')}"
    family = _FAMILY_OF.get(module_name, module_name)
    return f"kernels-{hashlib.sha256(where.encode()).hexdigest()[:12]}-{family}.lock"

# seconds an import waits for another process compiling kernels before compiling its own in memory; the test suite,
# whose conftest compiles the weight kernels beside the first tests, waits longer
LOCK_WAIT = float(os.environ.get("PAGEVIS_KERNEL_LOCK_WAIT", "15"))
VECTOR_BITS_ENV = "PAGEVIS_VECTOR_BITS"  # 256: LLVM's own vector width for this CPU (wide_vectors)

T = TypeVar("T")

_THREADS = threading.RLock()  # the process's half of the compile lock
_LOADED: dict[str, Any] = {}  # module name -> the module (or what `build` made of it), once imported
_holding = 0  # imports under way in this process while it holds the file lock (one nested in another's import)
_gave_up = False  # a wait for the file lock timed out: later imports take it only if it is free at once
_said_gave_up = False  # ... and that was said
_lock_file: IO[str] | None = None  # the lock file while it is open
_checked_sources = False  # the kernels' sources were checked against the cache's (drop_stale_kernels_once)
_said_unusable: set[str] = set()  # modules whose cache was said unusable (damaged), or 'no cache folder'


def _new_lock_in_child() -> None:
    """A forked child has one thread: the thread lock another thread of the parent held at the fork would never be
    released, and its copy of the lock file's descriptor would keep the file lock held (flock's lock is the open file's)
    for as long as the child lives, after the parent let go: both are let go here."""
    global _THREADS, _holding, _lock_file
    _THREADS, _holding = threading.RLock(), 0
    if _lock_file is not None:
        _lock_file.close()  # this process's copy only
        _lock_file = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


class KernelLoadError(RuntimeError):
    """numba could neither load nor compile a kernel module; the message names the module and says why."""


def cache_dir() -> Path:
    """Where pagevis keeps what it measures and builds (the compile lock, plans, weights, tokenizers, models):
    $PAGEVIS_CACHE_DIR, else $XDG_CACHE_HOME/pagevis, else ~/.cache/pagevis."""
    if os.environ.get("PAGEVIS_CACHE_DIR"):
        return Path(os.environ["PAGEVIS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagevis"


@overload
def import_kernels(module_name: str, what: str, *, seconds: int | None = None) -> ModuleType: ...


@overload
def import_kernels(module_name: str, what: str, *, build: Callable[[ModuleType], T], part: str = "",
                   seconds: int | None = None) -> T: ...


def import_kernels(module_name: str, what: str, *, build: Callable[[ModuleType], Any] | None = None, part: str = "",
                   seconds: int | None = None) -> Any:
    """The kernel module `module_name` imported under the compile lock, once a process (see the module docstring);
    with `build`, what build(module) returns (kernels it compiles when called), built under the lock too, once a
    process for each `part` (a module's kernels compiled on demand, one part at a time: batch_kernels' families).
    `what` names the kernels in what is said ("the decode attention kernel"); `seconds`: a first compile's time on
    an idle 2-core machine, said when numba starts compiling (None: a few seconds, nothing said)."""
    key = f"{module_name}:{part}" if part else module_name
    loaded = _LOADED.get(key)
    if loaded is not None:
        return loaded
    with _THREADS:
        loaded = _LOADED.get(key)
        if loaded is None:
            drop_stale_kernels_once()
            with _compile_lock(lock_name(module_name)) as held, _saying_when_compiling(what, seconds) as announce:
                loaded = _load(module_name, what, build, held, announce)
            _LOADED[key] = loaded
    return loaded


def drop_stale_kernels_once() -> None:
    """kernel_sources.drop_stale_kernels, once a process, before its first kernel loads (said when it dropped any); the
    tests call it before their modules import kernel modules directly (which load numba's cached code unchecked)."""
    global _checked_sources
    if _checked_sources:
        return
    _checked_sources = True
    from pagevis.kernel_sources import drop_stale_kernels

    if drop_stale_kernels():
        print("pagevis: the kernels' sources changed since numba compiled them; compiling them again",
              file=sys.stderr, flush=True)


def wide_vectors() -> None:
    """Let LLVM vectorise the kernels' loops with 512-bit registers where the CPU has AVX-512F. For Intel's server
    CPUs (Skylake-X to Emerald Rapids) LLVM's tuning prefers 256 bits ("prefer-256-bit", against the clock slowdown
    of older cores), so numba's default halves the width the kernels' float loops (dequantise and multiply-add over a
    64-weight tile, attention over keys) were written for; on an Emerald Rapids Xeon that made a SmolLM2 decode step
    ~1.3x slower than with it off (docs/speed.md). Applied as numba's CPU features, the host's with that tuning off,
    before the first kernel compiles; numba's on-disk cache is keyed by them, so each setting has its own entries.
    A user's NUMBA_CPU_NAME or NUMBA_CPU_FEATURES wins, and PAGEVIS_VECTOR_BITS=256 keeps LLVM's choice."""
    from numba.core import config

    if getattr(config, "CPU_NAME", None) or getattr(config, "CPU_FEATURES", None) or \
            os.environ.get(VECTOR_BITS_ENV, "") == "256":
        return
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if features.get("avx512f"):
        setattr(config, "CPU_FEATURES", features.flatten() + ",-prefer-256-bit")  # (numba's config module: untyped)


def _load(module_name: str, what: str, build: Callable[[ModuleType], Any] | None, held: bool, announce) -> Any:
    """The module (or build's result): from numba's cache or compiled into it; healed; in memory; else an error."""
    global _said_gave_up
    wide_vectors()
    def attempt() -> Any:
        try:
            module = importlib.import_module(module_name)
            return module if build is None else build(module)
        except BaseException:
            sys.modules.pop(module_name, None)  # (a failed import's module is gone already; a failed build's not)
            raise

    if held:
        try:
            return attempt()
        except Exception as exc:  # numba's cache: unpickling a damaged file, "no locator available", ...
            # said once a module (its parts compiled on demand say no more), and no cache folder once a process
            unusable = "no cache folder" if "no locator available" in str(exc) else module_name
            if unusable in _said_unusable:
                announce.said = True
            else:
                _say(announce, f"pagevis: numba's cache of {what} ({module_name}) cannot be used ({_reason(exc)}); "
                               "compiling them again")
                _said_unusable.add(unusable)
        with contextlib.suppress(Exception):
            with _damaged_cache_files_ignored():  # compiled and written over the damaged files: healed
                return attempt()
    else:  # said once a process: its later kernels too compile in memory while the lock is held
        if not _said_gave_up:
            _say(announce, f"pagevis: another process has held the kernels' compile lock for {LOCK_WAIT:g} s; "
                           f"compiling them in memory ({what}, and any others while it holds it)")
        _said_gave_up = announce.said = True
    try:
        with _numba_cache_off():
            return attempt()
    except Exception as exc:
        raise KernelLoadError(f"numba could not compile {what} ({module_name}): {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """An exception in one short line: its type and its message's first line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200]


def _say(announce, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    announce.said = True  # that line is all that is said of this module


@contextlib.contextmanager
def _compile_lock(name: str) -> Iterator[bool]:
    """The cache folder's lock file `name` held (fcntl.flock) while the caller imports, waiting LOCK_WAIT seconds at most
    for another process: True once held, False if it stayed held elsewhere (the caller compiles in memory). True
    without a lock where there is no fcntl or no writable cache folder, or a file system without locks, and inside
    an import that holds it already (a kernel module importing another through import_kernels)."""
    global _holding, _gave_up, _lock_file
    if _holding:
        yield True
        return
    try:
        import fcntl

        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / name, "a")
    except (ImportError, OSError):
        yield True
        return
    with lock:  # the lock goes with the file's closing
        held = _flock(fcntl, lock, 0.0 if _gave_up else LOCK_WAIT)
        _gave_up = _gave_up or not held
        _holding += held
        _lock_file = lock
        try:
            yield held
        finally:
            _holding -= held
            _lock_file = None


def _flock(fcntl, lock, wait: float) -> bool:
    """Whether the file's exclusive lock was taken within `wait` seconds (True also where locks are unsupported)."""
    import time

    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        except OSError:
            return True  # a file system without locks: go on alone


@contextlib.contextmanager
def _saying_when_compiling(what: str, seconds: int | None):
    """Say on stderr, once, when numba starts compiling (with `seconds` given); yields what `_say` marks said."""
    if seconds is None:
        yield _Said()
        return
    from numba.core import event

    class Announce(event.Listener):
        said = False

        def on_start(self, _):
            if not self.said:
                self.said = True
                print(f"pagevis: compiling {what} (numba, once: its on-disk cache keeps them; about {seconds} s on "
                      "an idle 2-core machine, longer on a busy one)", file=sys.stderr, flush=True)

        def on_end(self, _):
            pass

    announce = Announce()
    with event.install_listener("numba:compile", announce):
        yield announce


class _Said:
    said = False


@contextlib.contextmanager
def _damaged_cache_files_ignored():
    """numba's cache index and data files read as absent when they do not unpickle (a truncated .nbc, a garbage
    .nbi): numba then compiles and writes them again."""
    from numba.core import caching

    cls = caching.IndexDataCacheFile
    load_index, load_data = cls._load_index, cls._load_data

    def tolerant_index(self):
        try:
            return load_index(self)
        except Exception:
            return {}

    def tolerant_data(self, name):
        try:
            return load_data(self, name)
        except Exception:
            raise OSError(f"damaged numba cache file {name}") from None  # load() reads OSError as absent

    with _patched(cls, _load_index=tolerant_index, _load_data=tolerant_data):
        yield


@contextlib.contextmanager
def _numba_cache_off():
    """cache=True ignored: the kernels compiled in memory only (no usable cache folder, a read-only install), the
    njit functions' and the C functions' (cfunc: the weight families' kernels, compiled on demand)."""
    from numba.core import ccallback, dispatcher

    with _patched(dispatcher.Dispatcher, enable_caching=lambda self: None), \
            _patched(ccallback.CFunc, enable_caching=lambda self: None):
        yield


@contextlib.contextmanager
def _patched(owner: type, **methods: object):
    """numba's class owner with methods replaced (a monkeypatch: numba has no hook for these) while the block runs,
    its own methods put back after."""
    saved = {name: getattr(owner, name) for name in methods}
    for name, method in methods.items():
        setattr(owner, name, method)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(owner, name, method)

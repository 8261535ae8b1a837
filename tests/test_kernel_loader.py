"""kernel_loader.import_kernels, the one way a kernel module is imported: a damaged numba cache is healed (said once,
with why) and the kernels still compute what they should; threads importing at once build once; a lock another
process holds is waited for a bounded time; a module numba cannot compile is an error naming it; and every loader of
pagevis goes through it. Small kernel modules written for each test (compiled in well under a second), their cache
beside them in tmp_path and the lock in a private cache folder, so nothing here waits on the suite's own compiles
(test_hostile_caches.py does the same with the weight kernels, in processes: slow tests)."""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_layering import every_import

from pagevis import kernel_loader
from pagevis.kernel_loader import KernelLoadError, import_kernels

SUM = """
from numba import njit


@njit("float64(float64[::1])", cache=True)
def total(x):
    s = 0.0
    for v in x:
        s += v * v
    return s
"""

UNTYPABLE = """
from numba import njit


@njit("float64(float64)", cache=True)
def broken(x):
    return x.no_such_attribute
"""


@pytest.fixture
def kernel_module(tmp_path, monkeypatch, request):
    """A function writing a kernel module of the given source into tmp_path (importable) and returning its name;
    the compile lock in tmp_path's own cache folder; the module forgotten after the test."""
    names = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "pagevis"))
    monkeypatch.setattr(kernel_loader, "_gave_up", False)
    monkeypatch.setattr(kernel_loader, "_said_gave_up", False)

    def write(source: str) -> str:
        name = f"kernels_{request.node.name.split('[')[0][5:40]}_{len(names)}_{time.monotonic_ns()}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield write
    for name in names:
        forget(name)


def forget(name: str) -> None:
    """As a new process would find it: not imported (its numba cache files stay)."""
    sys.modules.pop(name, None)
    kernel_loader._LOADED.pop(name, None)


def squares(x: np.ndarray) -> float:
    return float(np.sum(x.astype(np.float64) ** 2))


@pytest.mark.parametrize("damage", ["garbage index", "truncated data"])
def test_a_damaged_cache_is_healed_once_saying_why_and_the_kernels_still_compute(kernel_module, capsys, damage):
    name = kernel_module(SUM)
    x = np.random.default_rng(0).standard_normal(1000)
    first = import_kernels(name, "the test kernels")
    assert first.total(x) == pytest.approx(squares(x), rel=1e-12)
    folder = Path(first.total._cache._cache_path)
    [index], [data] = folder.glob(f"{name}.total-*.nbi"), folder.glob(f"{name}.total-*.nbc")
    forget(name)
    if damage == "garbage index":
        index.write_bytes(b"garbage")
    else:
        data.write_bytes(data.read_bytes()[:40])
    capsys.readouterr()
    healed = import_kernels(name, "the test kernels")
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"numba's cache of the test kernels ({name}) cannot be used (" in said[0], said
    assert "compiling them again" in said[0] and "Traceback" not in said[0]
    assert healed is not first and healed.total(x) == pytest.approx(squares(x), rel=1e-12)
    forget(name)
    again = import_kernels(name, "the test kernels")  # the files were written again: loaded, silently
    assert capsys.readouterr().err == "" and sum(again.total.stats.cache_hits.values()) == 1
    assert again.total(x) == pytest.approx(squares(x), rel=1e-12)


def test_threads_importing_at_once_build_once_and_share_it(kernel_module):
    name = kernel_module(SUM)
    builds, results = [], [None] * 4
    start = threading.Barrier(len(results))

    def build(module):
        builds.append(threading.get_ident())
        time.sleep(0.2)  # the other threads arrive meanwhile
        return {"total": module.total}

    def load(i):
        start.wait()
        results[i] = import_kernels(name, "the test kernels", build=build)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and all(result is results[0] for result in results)
    assert results[0]["total"](np.ones(3)) == 3.0


def test_a_child_forked_while_another_thread_imports_kernels_imports_its_own(kernel_module):
    """The thread lock another thread held at the fork is not held in the child (its one thread would wait forever)."""
    slow, other = kernel_module(SUM), kernel_module(SUM.replace("v * v", "v"))
    inside, release = threading.Event(), threading.Event()

    def build(module):
        inside.set()
        release.wait(30)
        return module

    loader = threading.Thread(target=import_kernels, args=(slow, "the slow kernels"), kwargs={"build": build})
    loader.start()
    assert inside.wait(30)
    child = os.fork()
    if child == 0:  # (the file lock is the parent thread's until it is released below: the child waits for it)
        try:
            os._exit(0 if import_kernels(other, "the other kernels").total(np.arange(4.0)) == 6.0 else 1)
        finally:
            os._exit(2)
    release.set()
    loader.join()
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
    assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung or failed"


def test_a_lock_another_process_holds_is_waited_for_a_bounded_time_then_compiled_in_memory(kernel_module, tmp_path,
                                                                                              capsys, monkeypatch):
    monkeypatch.setattr(kernel_loader, "LOCK_WAIT", 0.5)
    first, second = kernel_module(SUM), kernel_module(SUM.replace("v * v", "v"))
    (tmp_path / "pagevis").mkdir()
    with open(tmp_path / "pagevis" / kernel_loader.lock_name(first), "a") as lock, \
            open(tmp_path / "pagevis" / kernel_loader.lock_name(second), "a") as other_lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (flock: another open file, as another process's, is refused it)
        fcntl.flock(other_lock, fcntl.LOCK_EX)
        started = time.monotonic()
        module = import_kernels(first, "the test kernels")
        waited = time.monotonic() - started
        said = capsys.readouterr().err.strip().splitlines()
        monkeypatch.setattr(kernel_loader, "LOCK_WAIT", 60.0)
        started = time.monotonic()
        other = import_kernels(second, "the other kernels")  # given up on once: not waited for again, nor said
        again = time.monotonic() - started
    assert waited >= 0.5 and again < 30 and capsys.readouterr().err == ""
    assert len(said) == 1 and "has held the kernels' compile lock for 0.5 s; compiling them in memory" in said[0]
    assert module.total(np.arange(4.0)) == 14.0 and other.total(np.arange(4.0)) == 6.0
    assert not list(tmp_path.rglob(f"{first}.*.nbi"))  # in memory: nothing written


def test_the_file_lock_is_one_a_numba_cache_not_one_a_machine(monkeypatch):
    """Another checkout or NUMBA_CACHE_DIR compiles into its own cache: it takes its own lock, and never waits for
    this one's compiles (the helpers' checkouts on one machine did)."""
    weights = "pagevis.model.weight_kernels"
    here = kernel_loader.lock_name(weights)
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/another/numba/cache")
    assert kernel_loader.lock_name(weights) != here
    monkeypatch.setattr(kernel_loader, "__file__", "/another/checkout/pagevis/kernel_loader.py")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert kernel_loader.lock_name(weights) != here


def test_a_kernel_module_imports_kernels_of_its_own_lock_family_only():
    """A kernel module importing another compiles that one under its own lock: were they of two families, a process
    compiling the other under the other's lock would compile it a second time beside it (or, nested the other way,
    the two could wait for each other). Modules of one family share a lock; any other has its own, so the attention
    kernels never wait for the weights' compile (a test run's first tests waited ~30 s for it)."""
    modules = KERNEL_MODULES
    assert {m for family in kernel_loader.FAMILIES.values() for m in family} <= modules  # no stale names
    imports = {name: {imported for _, imported in found} for _, name, _, found in every_import()}
    for module in modules:
        for other in imports[module] & modules:
            assert kernel_loader.lock_name(other) == kernel_loader.lock_name(module), f"{module} imports {other}"
    assert len({kernel_loader.lock_name(m) for m in modules}) == len(modules) - sum(
        len(family) - 1 for family in kernel_loader.FAMILIES.values())


def test_a_module_numba_cannot_compile_is_an_error_naming_it(kernel_module, capsys):
    name = kernel_module(UNTYPABLE)
    with pytest.raises(KernelLoadError, match=rf"numba could not compile the broken kernels \({name}\): TypingError"):
        import_kernels(name, "the broken kernels")
    assert name not in sys.modules and name not in kernel_loader._LOADED
    assert f"numba's cache of the broken kernels ({name}) cannot be used" in capsys.readouterr().err


def test_run_says_which_kernels_numba_could_not_compile_in_one_line(monkeypatch, capsys):
    """The decode kernel's every import failing (as a numba that cannot compile for this CPU would): `pagevis run`
    exits 2 with one line naming it, not an internal error."""
    from pagevis.__main__ import main
    from pagevis.kvcache import attention_kernels

    name, real = "pagevis.kvcache.decode_kernel", importlib.import_module

    def refuse(module_name, *args):
        if module_name == name:
            raise ImportError("simulated: no code generation for this CPU")
        return real(module_name, *args)

    monkeypatch.setattr(attention_kernels, "_decode_kernel", None)
    monkeypatch.delitem(kernel_loader._LOADED, name, raising=False)
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(kernel_loader.importlib, "import_module", refuse)
    capsys.readouterr()
    assert main(["run", "--model", "synthetic", "--prompt", "hi", "--max-tokens", "2", "--no-chat"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1] == (f"pagevis run: error: numba could not compile the decode attention kernel ({name}): "
                        "ImportError: simulated: no code generation for this CPU"), said


KERNEL_MODULES = {f"pagevis.{name}" for name in ("model.weight_kernels", "model.batch_kernels", "model.fused_kernels", "model.int8_kernels",
                                                 "model.spin_pool", "kvcache.decode_kernel",
                                                 "kvcache.batch_decode_kernel", "kvcache.chunk_kernel",
                                                 "kvcache.policies.kernels")}


def test_every_kernel_module_is_loaded_through_import_kernels():
    """No module of pagevis imports a kernel module itself, but another kernel module (the inlined helpers they
    share) and quantized.py's type-only import of spin_pool's SpinPool (under TYPE_CHECKING)."""
    allowed = {("pagevis.model.quantized", "pagevis.model.spin_pool")}
    found = [(name, target) for _path, name, _package, targets in every_import() if name not in KERNEL_MODULES
             for _line, target in targets if any(target == kernel or target.startswith(kernel + ".")
                                                 for kernel in KERNEL_MODULES)]
    assert set(found) <= allowed, sorted(set(found) - allowed)


_VECTOR_PROBE = """
import numpy as np
from numba import njit
from pagevis.kernel_loader import wide_vectors
wide_vectors()
@njit(fastmath=True)
def axpy(a, x, y):
    for i in range(x.size):
        y[i] += a * x[i]
x = np.ones(1024, np.float32)
axpy(np.float32(2), x, x.copy())
print("zmm" in next(iter(axpy.inspect_asm().values())))
"""


@pytest.mark.skipif(not __import__("llvmlite.binding").binding.get_host_cpu_features().get("avx512f"),
                    reason="this CPU has no AVX-512F")
def test_kernels_vectorise_with_512_bit_registers_where_the_cpu_has_avx512(tmp_path):
    """LLVM's tuning for Intel's server CPUs prefers 256-bit vectors; wide_vectors turns that off for the kernels
    (a float loop then uses zmm registers), unless a user's NUMBA_CPU_FEATURES says otherwise."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU", "PAGEVIS_VECTOR"))}
    env.update(NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    wide = subprocess.run([sys.executable, "-c", _VECTOR_PROBE], env=env, capture_output=True, text=True, check=True)
    assert wide.stdout.strip() == "True", wide.stderr
    chosen = subprocess.run([sys.executable, "-c", _VECTOR_PROBE], env={**env, "NUMBA_CPU_FEATURES": "+avx2,+fma"},
                            capture_output=True, text=True, check=True)
    assert chosen.stdout.strip() == "False", "a user's NUMBA_CPU_FEATURES must win"


@pytest.mark.skipif(not __import__("llvmlite.binding").binding.get_host_cpu_features().get("avx512f"),
                    reason="this CPU has no AVX-512F")
def test_the_tests_run_the_kernels_the_app_runs():
    """numba makes its code generator once a process, at the first @njit, with the CPU features of that moment; the
    test modules import kernel modules directly (the app only through kernel_loader, after wide_vectors), so
    conftest sets them first. Without it this process compiled every kernel for 256-bit vectors, again beside the
    background loader's 512-bit ones (numba's cache is keyed by the features)."""
    from numba.core.registry import cpu_target

    if os.environ.get("NUMBA_CPU_FEATURES") or os.environ.get("PAGEVIS_VECTOR_BITS") == "256":
        pytest.skip("the CPU features are the user's")
    assert "-prefer-256-bit" in cpu_target.target_context.codegen().magic_tuple()[2]


def test_the_tests_check_the_kernels_sources_before_any_kernel_loads():
    """conftest runs the stale-source check before test modules import kernel modules directly (which load numba's
    cached code unchecked): without it a change to kernel_intrinsics.py alone ran the old inlined code."""
    from pagevis import kernel_loader

    assert kernel_loader._checked_sources


def test_a_change_to_any_kernel_source_drops_every_kernel_modules_numba_cache(tmp_path, monkeypatch):
    """numba checks only a compiled function's own file; a kernel inlining another module's code must go too when
    that module changes (kernel_sources.py)."""
    from pagevis import kernel_sources

    package = tmp_path / "pagevis"
    cache = package / "model" / "__pycache__"
    cache.mkdir(parents=True)
    (package / "model" / "tile_sums.py").write_text("from numba import njit  # inlined by spin_pool\n")
    (package / "model" / "spin_pool.py").write_text("import numba\n")
    (package / "model" / "plain.py").write_text("x = 1\n")
    monkeypatch.setattr(kernel_sources, "PACKAGE", package)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def cached() -> list[str]:
        for name in ("spin_pool.run-317.py311.nbi", "spin_pool.run-317.py311.1.nbc", "tile_sums.sums-40.py311.nbi"):
            (cache / name).touch(exist_ok=True)
        (cache / "plain.cpython-311.pyc").touch(exist_ok=True)
        return sorted(p.name for p in cache.iterdir())

    everything = cached()
    assert kernel_sources.drop_stale_kernels()  # no record yet: what is there may be from any sources
    assert sorted(p.name for p in cache.iterdir()) == ["plain.cpython-311.pyc"]
    assert kernel_sources.record().is_file()
    assert cached() == everything
    assert not kernel_sources.drop_stale_kernels()  # the same sources: kept
    assert sorted(p.name for p in cache.iterdir()) == everything
    (package / "model" / "tile_sums.py").write_text("from numba import njit  # changed\n")
    assert kernel_sources.drop_stale_kernels()
    assert not any(p.suffix in (".nbi", ".nbc") for p in cache.iterdir())  # spin_pool's too, though unchanged


def test_stale_kernels_are_found_under_numba_cache_dir(tmp_path, monkeypatch):
    """With NUMBA_CACHE_DIR set (or in numba's per-user cache), numba keeps a folder's kernels in '<folder
    name>_<SHA-1 of its path>', named by numba's own locator here: no 'pagevis' in it, so until session 17 none of
    them were found, and a changed source left the other modules' inlined copies of it running."""
    from numba.core.caching import _CacheLocator

    from pagevis import kernel_sources

    sources = kernel_sources.kernel_sources()
    cache = tmp_path / "numba"
    placed = set()
    for source in sources:
        folder = cache / _CacheLocator.get_suitable_cache_subpath(str(source))
        folder.mkdir(parents=True, exist_ok=True)
        placed |= {folder / f"{source.stem}.kernel-10.py311.nbi", folder / f"{source.stem}.kernel-10.py311.1.nbc"}
        for file in placed:
            file.touch()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    assert set(kernel_sources.numba_cache_files(sources)) == placed  # the checkout's own __pycache__ is not this one
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # numba's per-user cache: $XDG_CACHE_HOME/numba
    assert placed <= set(kernel_sources.numba_cache_files(sources))


@pytest.mark.slow
def test_a_kernel_compiled_under_numba_cache_dir_is_found(tmp_path, monkeypatch):
    """The same, with the cache numba writes: a real process compiles a policy kernel under NUMBA_CACHE_DIR."""
    import subprocess

    from pagevis import kernel_sources

    cache = tmp_path / "numba"
    script = ("import numpy as np\nfrom pagevis.kvcache.policies.kernels import newest_mask\n"
              "newest_mask(np.arange(4, dtype=np.int64), 2)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})
    compiled = {p for p in cache.rglob("*") if p.suffix in (".nbi", ".nbc")}
    assert any(p.name.startswith("kernels.newest_mask") for p in compiled)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    assert compiled <= set(kernel_sources.numba_cache_files(kernel_sources.kernel_sources()))


def test_the_matrix_descriptors_layout_is_a_kernel_source_and_loads_no_numba():
    """matrix_descriptor.py holds the words' positions the kernels read (batch_kernels' `_nib_arrays` and
    `_i8_arrays`, inlined into rows_kernel and the spin pool's row_kernel): numba compiles them in as constants, so a
    change to it must drop the kernels' cache (kernel_sources fingerprints the modules that mention numba); and a
    QuantMatrix builds its descriptor without numba (plain NumPy)."""
    import subprocess

    from pagevis import kernel_sources

    assert kernel_sources.PACKAGE / "model" / "matrix_descriptor.py" in kernel_sources.kernel_sources()
    code = "import sys, pagevis.model.matrix_descriptor; print(sorted(m for m in sys.modules if 'numba' in m))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert loaded.stdout.strip() == "[]"

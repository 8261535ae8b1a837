import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import settings

from pagevis.kernel_loader import drop_stale_kernels_once, wide_vectors

# Tests never need a screen; `make test` sets this too, this covers a bare `pytest`.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The kernels' compile lock is held by weight_kernels_ready_beside's process (a live compiler, ~75 s on a clean
# checkout): tests wait for it rather than compile their own in memory after the app's 15 s.
os.environ.setdefault("PAGEVIS_KERNEL_LOCK_WAIT", "600")
# The apps the tests launch as processes keep their settings (QSettings) here, never in the user's ~/.config: a
# `--screenshot` run saved its session there, and the next plain launch (CI's rehearsal) opened it. Absolute, since
# Qt ignores a relative XDG_CONFIG_HOME.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="pagevis-test-config-")

# numba's CPU features as the app sets them before its first kernel (kernel_loader.wide_vectors: on AVX-512 CPUs,
# 512-bit vectors), before any test module is imported: a module with a kernel, imported directly, makes numba's
# code generator at its first @njit, with the CPU features of that moment, for the whole process. Without this the
# tests ran kernels compiled for 256-bit vectors -- not what users run -- and on a clean clone compiled every kernel
# again beside the background loader's (numba's cache is keyed by the features; measured: test_batch_kernels,
# test_spin_pool and test_int8_prompt_rows after the loader's steps, 143 s before, ~25 s after).
wide_vectors()
# The kernels' sources checked against what numba's cache was compiled from, before a test module imports a kernel
# module directly (which loads its cached code unchecked): numba checks only a function's own file, so a change to
# kernel_intrinsics.py alone had the tests run the old inlined code (found by a mutant that passed).
drop_stale_kernels_once()

# Property tests draw the same examples on every run, so a CI failure is reproducible from a clean clone (a random
# draw failed CI once on an example no earlier run had met); PAGEVIS_HYPOTHESIS_EXPLORE=1 draws new ones each run.
settings.register_profile("pagevis", derandomize=not os.environ.get("PAGEVIS_HYPOTHESIS_EXPLORE"))
settings.load_profile("pagevis")


# What the background loader compiles, in the order the tests first need it: the weight kernels, SmolLM2's families'
# kernels (one row and rows) and the repacking and dequantising ones its file needs, the spin pool (two weight
# threads), the int8 batch kernels (where the CPU has VNNI), the batched decode attention (its own lock; first needed
# by test_attention_pool_handin's process, which compiled it there: 22 s of a clean clone's make test on this Intel
# CPU) and the chunks' (chunk_kernel.py: an engine test's step of several prompts), the decode kernels' float16
# pages' variants (test_compare's float16 rows compiled them: 44 s), then every other family's and on-demand kernel
# (the GGUF tests' other types, Gemma 3's), each compiled on first use since session 17 (a first launch compiles only
# its model's).
_LOADER_STEPS = (
    "from pagevis.model.quantized import kernels; kernels()",
    "from pagevis.model.quantized import preload_families, weight_kernel; preload_families(('u4', 'i8')); "
    "[weight_kernel(name) for name in ('repack_nib', 'repack_i8', 'i8_dequant')]",
    "from pagevis.model.weight_threads import set_weight_threads; from pagevis.model.quantized import spin_pool; "
    "set_weight_threads(2); spin_pool()",
    "from pagevis.model import int8_rows; int8_rows.route() == 'vnni' and int8_rows._kernels()",
    "from pagevis.kvcache.attention_kernels import batch_decode_kernels; batch_decode_kernels()",
    "from pagevis.kvcache.paged_attention import chunk_kernels; chunk_kernels()",
    "from pagevis.kvcache import decode_kernel; from pagevis.kvcache.attention_kernels import batch_decode_kernels; "
    "from pagevis.kvcache.paged_attention import chunk_kernels; "
    "decode_kernel.half_kernels(); batch_decode_kernels().half_kernels(); chunk_kernels().half_kernels()",
    "from pagevis.model.batch_kernels import ROW_FAMILIES; from pagevis.model.quantized import preload_families; "
    "preload_families(tuple(ROW_FAMILIES))",
    "from pagevis.model.quantized import weight_kernel; from pagevis.model.weight_kernels import LAZY; "
    "[weight_kernel(name) for name in LAZY]",
)
# The loader lets go of the compile lock between its steps for this long: one lock covers the weights' kernel modules
# (kernel_loader.FAMILIES), and a test waiting for one (polling every 0.1 s) lost the lock to the loader's next step
# each time it was let go -- on a clean clone the first model test waited ~80 s for kernels compiled long before
# (kernel_loader._flock). The attention, fused and policy kernels have locks of their own: the tests compile them.
_LOADER_PAUSE = 0.4


# Modules that multiply packed weights (the loader's kernels), measured: a run with quantized.kernels, _rows_kernel,
# spin_pool, QuantMatrix.product and int8_rows._kernels wrapped to note each test module calling them, plus
# test_hostile_caches (its processes load them). They run last, after the ~100 s of tests that need none of them, so
# on a clean clone they find those kernels compiled rather than wait for them (one at a time, moved behind the
# others, each left the next waiting: test_api 40-100 s, test_batch_decode_kernel 160 s, test_cli's headless
# commands 31 s, test_cli_bench 41 s, test_compare 22 s, test_engine_attention 42 s; on session 16's Intel CPU,
# test_gui's GGUF launch 74 s, test_attention_pool_handin's batches 71 s, test_cli's headless commands 61 s,
# test_hostile_prompts' SmolLM2 69 s, test_engine_disk's full swap folder 62 s, test_rerotate's tiny GGUF 9-11 s, and
# test_gui_presets' Gemma preset past its 30 s: its worker was still waiting for the spin pool's kernels when the test
# ended, and every later two-thread test of that run found the pool unavailable -- quantized._POOL_FAILED, the
# exception's line lost in a passing test's captured stderr; session 18: test_model_loading's SmolLM2 15 s,
# test_rope_scaling's tiny GGUFs 4 s, test_compare's float16 rows 44 s). A module missing here only waits; one
# listed that needs none of them only runs later.
_RUN_LAST = ("test_api.py", "test_attention_pool_handin.py", "test_batch_decode_kernel.py", "test_batch_kernels.py",
             "test_cli.py", "test_cli_bench.py", "test_compare.py", "test_decode_split.py", "test_engine_bench.py",
             "test_engine_disk.py", "test_engine_quant.py", "test_fused_kernels.py", "test_fuzz_files.py",
             "test_gui.py", "test_gui_demo.py", "test_gui_presets.py", "test_hostile_caches.py",
             "test_hostile_layout.py", "test_hostile_prompts.py", "test_int8_prompt_rows.py", "test_int8_rows.py",
             "test_model_loading.py", "test_model_reference.py", "test_preset_proofs.py", "test_rerotate.py",
             "test_resident.py", "test_rope_scaling.py", "test_spin_pool.py", "test_weight_kernels.py",
             "test_weights_bench.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in _RUN_LAST)  # stable: the order within each part is kept


@pytest.fixture(autouse=True, scope="session")
def weight_kernels_ready_beside():
    """Load (on a clean checkout: compile, ~75 s) the quantized-weight kernels in another process while the first
    tests run on this core: a test that needs them waits on their lock (kernel_loader._compile_lock) for what is
    left of the step compiling them (PAGEVIS_KERNEL_LOCK_WAIT above; the app waits 15 s, then compiles its own in
    memory), then loads them from numba's cache."""
    script = f"import time\nfor step in {_LOADER_STEPS!r}:\n    exec(step)\n    time.sleep({_LOADER_PAUSE})\n"
    loader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield
    loader.wait()


@pytest.fixture(autouse=True)
def private_settings(request, tmp_path):
    """GUI tests (test_gui*.py) never read or write the user's settings."""
    if not request.module.__name__.startswith("test_gui"):
        yield
        return
    from PySide6.QtCore import QSettings

    from pagevis.gui.widgets import theme

    qapp = request.getfixturevalue("qapp")
    QSettings.setDefaultFormat(QSettings.IniFormat)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path / "settings"))
    qapp.setOrganizationName("pagevis-tests")
    qapp.setApplicationName("pagevis-tests")
    theme.configure_pyqtgraph()
    yield


@pytest.fixture(autouse=True)
def gui_thread_collection(request):
    """Cyclic garbage is collected on the GUI thread, as in the app (pagevis.gui.widgets.gui_gc), for every test
    that uses Qt and every test after it: the collector ran on whichever thread allocated, and a GUI test's model
    loader thread, collecting, destroyed earlier tests' Qt objects there: "Fatal Python error: Aborted" (CI once,
    and `make test` here: the loader "Garbage-collecting" in vocab_tokenizer._merge_pairs). Once installed, the
    automatic collector is off; each test's teardown collects on the main thread what the thresholds call for."""
    from_qt = {"qtbot", "qapp"} & set(request.fixturenames)
    if from_qt:
        from pagevis.gui.widgets import gui_gc

        gui_gc.install(request.getfixturevalue("qapp"))
    yield
    if "pagevis.gui.widgets.gui_gc" in sys.modules:
        from pagevis.gui.widgets import gui_gc

        if gui_gc.installed() is not None:
            gui_gc.installed().check()


@pytest.fixture
def window(qtbot, tmp_path):
    """The main window on the synthetic model with a 4 x 4 cache, started and ready (see gui_helpers)."""
    from gui_helpers import make_window

    return make_window(qtbot, tmp_path)

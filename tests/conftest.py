import gc
import os
import subprocess
import sys

import pytest
from hypothesis import settings

# Tests never need a screen; `make test` sets this too, this covers a bare `pytest`.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The kernels' compile lock is held by weight_kernels_ready_beside's process (a live compiler, ~25-60 s on a clean
# checkout): tests wait for it rather than compile their own in memory after the app's 15 s.
os.environ.setdefault("PAGEVIS_KERNEL_LOCK_WAIT", "600")

# Property tests draw the same examples on every run, so a CI failure is reproducible from a clean clone (a random
# draw failed CI once on an example no earlier run had met); PAGEVIS_HYPOTHESIS_EXPLORE=1 draws new ones each run.
settings.register_profile("pagevis", derandomize=not os.environ.get("PAGEVIS_HYPOTHESIS_EXPLORE"))
settings.load_profile("pagevis")


@pytest.fixture(autouse=True, scope="session")
def weight_kernels_ready_beside():
    """Load (on a clean checkout: compile, ~25 s) the quantized-weight kernels in another process while the first
    tests run on this core: the first test that needs them waits on their lock (quantized._compiling_alone) for what
    is left (PAGEVIS_KERNEL_LOCK_WAIT above; the app waits 15 s, then compiles its own in memory), then loads them
    from numba's cache."""
    loader = subprocess.Popen([sys.executable, "-c", "from pagevis.model.quantized import kernels; kernels()"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    # Cyclic garbage collection stays on, as in the app. CI aborted once ("Fatal Python error: Aborted") while the
    # main thread collected garbage during a GUI test's SmolLM2 load; the one way found to abort so is a collection
    # destroying a QThread that still runs (Qt's qFatal; tests/test_gui_owned_thread.py reproduces it), which the
    # attach window's workers could be after its stop() gave up waiting: they are OwnedThreads now, held until they
    # finish. PAGEVIS_GUI_GC=0 turns the collector off during GUI tests again (collecting at teardown), to bisect.
    if os.environ.get("PAGEVIS_GUI_GC") != "0":
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture
def window(qtbot, tmp_path):
    """The main window on the synthetic model with a 4 x 4 cache, started and ready (see gui_helpers)."""
    from gui_helpers import make_window

    return make_window(qtbot, tmp_path)

"""Two ways a collection aborts a Qt app ("Fatal Python error: Aborted", issue #44): a worker QThread destroyed while
it runs (qFatal "QThread: Destroyed while thread is still running"; OwnedThread, the attach window's workers, is held
until it has finished, so neither a collection nor the exit destroys one that runs: each case in its own process,
the failure being an abort), and Qt objects collected on a worker thread (the CI abort: the collector ran on a
model loader's thread; gui_gc collects on the GUI thread only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROGRAM = """
import gc, sys, time
from PySide6.QtCore import QCoreApplication, QObject, QThread
from pagevis.gui.widgets.owned_thread import OwnedThread
app = QCoreApplication([])
Base = {base}
class Worker(Base):
    def run(self):
        while not self.isInterruptionRequested():
            time.sleep(0.01)
        time.sleep(0.2)
worker = Worker()
worker.slot = lambda: worker  # a cycle, as a window's connected slots make
worker.start()
time.sleep(0.1)
del worker
gc.collect()
print("collected", flush=True)
"""


@pytest.mark.parametrize("base", ["QThread", "OwnedThread"])
def test_a_running_worker_is_never_destroyed(base):
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(base=base)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    if base == "QThread":  # the failure this guards against, reproduced: a plain worker aborts the process
        assert done.returncode != 0 and "Destroyed while thread" in done.stderr, done.stderr
    else:
        assert done.returncode == 0 and done.stdout == "collected\n" and done.stderr == "", done.stderr


def test_cyclic_garbage_is_collected_on_the_gui_thread_only(qapp, qtbot):
    """Once the app's collector is installed, a worker thread that allocates past every threshold collects nothing
    (it collected earlier tests' Qt objects on itself: the abort); the GUI thread's timer collects the cycles."""
    import gc
    import threading
    import weakref

    from PySide6.QtCore import QObject

    from pagevis.gui.widgets import gui_gc

    gui_gc.install(qapp)
    threads: list[int] = []

    def record(phase, info):
        if phase == "start":
            threads.append(threading.get_ident())

    gc.callbacks.append(record)
    try:
        class Window:  # a Python object holding a Qt one, in a cycle (as a window and its connected slots)
            pass

        holder = Window()
        holder.me, holder.qt = holder, QObject()  # only the cyclic collector can free them
        gone = weakref.ref(holder)
        del holder
        kept: list = []  # kept: the collector's count stays past its threshold (freed lists lower it again)
        worker = threading.Thread(target=lambda: kept.append([[index] for index in range(300_000)]))
        worker.start()
        worker.join()
        assert all(ident == threading.get_ident() for ident in threads)
        qtbot.waitUntil(lambda: gone() is None, timeout=10_000)
    finally:
        gc.callbacks.remove(record)
    assert threads and set(threads) == {threading.get_ident()} and not gc.isenabled()

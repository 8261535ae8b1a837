"""A worker QThread destroyed while it runs aborts the process (qFatal "QThread: Destroyed while thread is still
running": "Fatal Python error: Aborted", as CI aborted once with the garbage collector running on the GUI thread).
OwnedThread (the attach window's workers) is held until it has finished, so neither a collection nor the exit
destroys one that runs. Each case runs in its own process: the failure is an abort."""

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

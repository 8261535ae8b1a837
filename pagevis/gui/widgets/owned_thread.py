"""A QThread that is never destroyed while it runs.

Destroying a running QThread is fatal in Qt (qFatal "QThread: Destroyed while thread is still running": the process
aborts, "Fatal Python error: Aborted"). A Python-owned worker thread is destroyed when its wrapper is collected, and
a window and its workers form reference cycles (connected slots), so a collection could destroy a worker that a
window's stop() left running (it waits a few seconds only) together with the closed window: reproduced with a
QThread child of a collected QObject (tests/test_gui_owned_thread.py). This was a suspect for issue #44's CI abort;
the cause found was another (a collection on a worker thread: gui_gc.py), but the guard stays. Every OwnedThread
started is held here, from the GUI thread, until it has finished; at exit, each still running is asked to stop and
waited for.
"""

from __future__ import annotations

import atexit

import shiboken6
from PySide6.QtCore import QThread

STOP_AT_EXIT_MS = 5000
_started: set[QThread] = set()


class OwnedThread(QThread):
    """start() (on the GUI thread) keeps the thread referenced until it has finished."""

    def start(self, *args) -> None:
        keep_until_finished(self)
        super().start(*args)


def keep_until_finished(thread: QThread) -> None:
    """Hold thread (and let go of the started ones that have finished). Only the GUI thread calls this: a release
    from the worker's own `finished` signal would drop the last reference on that thread, while it still runs."""
    for done in [t for t in _started if not shiboken6.isValid(t) or t.isFinished()]:
        _started.discard(done)
    _started.add(thread)


def running() -> list[QThread]:
    """The held threads still running (one whose C++ object its parent already deleted is not: Qt deletes a
    thread only once it has finished, and asking the wrapper raised RuntimeError at exit)."""
    return [t for t in _started if shiboken6.isValid(t) and t.isRunning()]


@atexit.register
def _stop_at_exit() -> None:
    for thread in running():
        thread.requestInterruption()
        thread.wait(STOP_AT_EXIT_MS)

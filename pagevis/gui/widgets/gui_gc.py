"""Cyclic garbage collection on the GUI thread only.

Python's cyclic collector runs on whichever thread happens to allocate past its threshold. In the app that is often
a worker thread (a model load builds SmolLM2's 49k merge pairs on one), and the garbage it then finalizes includes
Qt objects of closed windows (windows and their slots form reference cycles): a Qt object destroyed on a thread
that is not its own is fatal in Qt. CI aborted so ("Fatal Python error: Aborted", the loader thread
"Garbage-collecting" in vocab_tokenizer._merge_pairs: issue #44; pytest-qt's message handler swallowed Qt's own
line). So the app turns the automatic collector off and collects on the GUI thread from a timer, generation by
generation with the interpreter's own thresholds (as pyqtgraph's GarbageCollector does); worker threads never
collect. Reference counting still frees everything outside cycles at once.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 500
_installed: GuiThreadCollector | None = None


class GuiThreadCollector(QObject):
    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS):
        super().__init__(parent)
        self.thresholds = gc.get_threshold()
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.check)
        self.timer.start(interval_ms)

    def check(self) -> None:
        """Collect the generations whose counts passed their thresholds (what the automatic collector would do)."""
        counts = gc.get_count()
        if counts[0] > self.thresholds[0]:
            generation = 2 if counts[2] > self.thresholds[2] else 1 if counts[1] > self.thresholds[1] else 0
            gc.collect(generation)


def install(app: QObject) -> GuiThreadCollector:
    """The one collector of the process, made (on the GUI thread, owned by the application) on first call."""
    global _installed
    if _installed is None:
        _installed = GuiThreadCollector(app)
    return _installed


def installed() -> GuiThreadCollector | None:
    return _installed

"""Guard against a reference-counting bug of shiboken6/PySide6 6.12.0 on Python < 3.12.

In that release every Qt method that returns nothing (QPainter.save, QColor.setRed, ...) drops one
reference to Python's `None` without having taken it, and some calls into Python overrides do the same
to `True`/`False`. On Python 3.12+ these objects are immortal and nothing happens; on 3.11 their counts
sink by hundreds per redraw and the interpreter aborts within seconds of playback ("Fatal Python error:
none_dealloc" / "bool_dealloc"). PySide6 6.11.3 does not have the bug. The proper fix is a PySide6
without it (see docs/gui.md); until then, `protect_singletons()` detects the leak and, only if it is
there, gives these static singletons the effectively-infinite reference count that CPython 3.12 gives
them by design (PEP 683, immortal objects). Nothing else is touched.
"""

from __future__ import annotations

import ctypes
import sys

_PROBE_CALLS = 64
_HEADROOM = 1 << 60


def leaks_none() -> bool:
    """True if a void Qt call drops a reference to None (measured, not guessed from version numbers)."""
    from PySide6.QtCore import QPoint

    point = QPoint()
    before = sys.getrefcount(None)
    for _ in range(_PROBE_CALLS):
        point.setX(1)
    return before - sys.getrefcount(None) >= _PROBE_CALLS // 2


def protect_singletons() -> bool:
    """Make the singletons' reference counts unreachable by the leak; True if the guard was needed."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or not leaks_none():
        return False
    for singleton in (None, True, False, *range(-5, 257), "", ()):  # statically allocated in CPython 3.11
        refcount = ctypes.c_ssize_t.from_address(id(singleton))  # ob_refcnt: a PyObject's first field
        if refcount.value < _HEADROOM:
            refcount.value += _HEADROOM
    return True


PROTECTED = protect_singletons()

"""Delete the app's windows before the interpreter exits.

Left to PySide's exit handler, a closed window's pyqtgraph items are destroyed while Python is being finalized, and
their Python overrides are then called on half-torn objects: a segmentation fault after the process had said all
it had to say (CI: `--screenshot` of a model that cannot load exited -11 one run in two). Deleting the main windows
on the GUI thread while Python is whole ends that. Only the windows: deleting every top-level widget (pyqtgraph's
context menus among them) crashes in its own way.
"""

from __future__ import annotations

import functools
import sys


def delete_windows() -> None:
    if "PySide6.QtWidgets" not in sys.modules:  # nothing was opened (no display: the check exits before Qt loads)
        return
    from PySide6.QtCore import QCoreApplication, QEvent
    from PySide6.QtWidgets import QApplication, QMainWindow

    if QApplication.instance() is None:
        return
    for widget in QApplication.topLevelWidgets():
        if isinstance(widget, QMainWindow) and widget.parent() is None:
            widget.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def windows_deleted_on_return(launcher):
    """`launcher` (a function that opens windows and returns an exit code), its windows deleted when it returns."""

    @functools.wraps(launcher)
    def wrapped(*args, **kwargs):
        try:
            return launcher(*args, **kwargs)
        finally:
            delete_windows()

    return wrapped

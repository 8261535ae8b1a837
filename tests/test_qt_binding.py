"""The installed Qt binding does not leak references to None (PySide6 6.12.0 does: on Python 3.11 the
app then aborts with "Fatal Python error: none_dealloc" within seconds of playback)."""

import sys


def test_void_qt_calls_keep_none_alive():
    from PySide6.QtCore import QPoint

    point = QPoint()
    before = sys.getrefcount(None)
    for _ in range(200):
        point.setX(1)
    assert before - sys.getrefcount(None) < 50, "this PySide6 leaks None; install PySide6-Essentials<6.12"

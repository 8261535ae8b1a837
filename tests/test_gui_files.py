"""The main window's files and other windows: Save trace on a worker thread, confirmed; the Attach window from the
View menu (endpoints, or a KV-event recording)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import make_window  # noqa: E402
from PySide6.QtWidgets import QFileDialog  # noqa: E402

from pagevis.trace import read_trace  # noqa: E402

RECORDING = Path(__file__).parent / "data" / "kv_events" / "vllm-0.34.0.kvev"


@pytest.fixture
def window(qtbot, tmp_path):
    return make_window(qtbot, tmp_path)


def test_save_trace_from_the_menu_writes_on_a_worker_and_confirms(qtbot, tmp_path, window, monkeypatch):
    window.runner.step_blocking(5)
    target = tmp_path / "menu.pvtrace"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(target), ""))
    action = next(a for a in window.menuBar().actions()[0].menu().actions() if a.text() == "&Save trace…")
    action.trigger()  # returns before the file is written: the window goes on
    assert window.files.savers and "Saving 5 steps" in window.statusBar().currentMessage()
    qtbot.waitUntil(lambda: not window.files.savers, timeout=120_000)
    assert len(read_trace(target).records) == 5
    assert window.files.saved_box.isVisible() and str(target) in window.files.saved_box.text()
    assert "Saved 5 steps" in window.statusBar().currentMessage()
    window.files.saved_box.close()


def test_the_attach_window_is_in_the_view_menu(qtbot, window, monkeypatch):
    view = next(a.menu() for a in window.menuBar().actions() if a.text() == "&View")
    attach = next(a.menu() for a in view.actions() if a.menu() is not None and "Attach" in a.text())
    assert [a.text() for a in attach.actions()] == ["&Endpoints (vLLM, SGLang, pagevis serve)…",
                                                    "&Play a KV-event recording…"]
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(RECORDING), ""))
    attach.actions()[1].trigger()
    opened = window.files.attach_window
    qtbot.addWidget(opened)
    try:
        assert opened.isVisible() and "recording" in opened.windowTitle()
    finally:
        opened.close()
    assert window.files.open_attach("not an endpoint") is None and "Attach" in window.statusBar().currentMessage()

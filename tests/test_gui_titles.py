"""Window titles say what the window shows: a replay is not "live", the Server window does not say "server" twice."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import SYNTH, make_window, write_synthetic_trace  # noqa: E402


def test_a_replay_is_titled_a_replay_and_a_live_session_live(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    assert window.windowTitle().endswith("live") and SYNTH.label in window.windowTitle()
    path, _ = write_synthetic_trace(tmp_path, 3)
    assert window.open_trace(str(path))
    assert "live" not in window.windowTitle() and "replay of run.pvtrace" in window.windowTitle()


def test_the_server_windows_title_names_its_preset_once(qtbot):
    from pagevis.gui.server.window import ServerWindow
    from pagevis.presets import SERVER_PRESETS

    server = ServerWindow(SYNTH.load(), SERVER_PRESETS[0], realtime=False, model_label="Gemma 3 270M")
    qtbot.addWidget(server)
    title = server.windowTitle()
    assert title.count("erver") == 1 and "shared system prompt" in title and "(Gemma 3 270M)" in title

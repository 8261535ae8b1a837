"""Help ▸ Tour drives the real windows: the StreamingLLM A/B playing, then Sequences running, then the Server
serving, each step with its one line."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402


def test_the_tour_opens_and_runs_each_window_in_turn(qtbot, window):
    from pagevis.gui.session.tour import STEPS

    tour = window.start_tour()
    qtbot.addWidget(tour)
    ab = window.ab_window
    qtbot.addWidget(ab)
    assert tour.title.text() == STEPS[0][0] and tour.line.text() == STEPS[0][1]
    assert "StreamingLLM" in ab.windowTitle() and [c.policy for c in ab.configs()] == ["oldest", "sinks"]
    qtbot.waitUntil(lambda: ab.timeline is not None and len(ab.timeline) >= 3, timeout=120_000)  # it plays
    ab.toggle_play()
    qtbot.waitUntil(lambda: not ab.runner.busy, timeout=10000)
    tour.next()
    seqs = window.files.sequences_window
    qtbot.addWidget(seqs)
    assert tour.title.text() == STEPS[1][0]
    qtbot.waitUntil(lambda: len(seqs.records) >= 3, timeout=120_000)  # running
    seqs.run_button.setChecked(False)
    qtbot.waitUntil(lambda: not seqs.busy, timeout=10000)
    tour.next()
    server = window.files.server_window
    qtbot.addWidget(server)
    assert tour.title.text() == STEPS[2][0] and tour.next_button.text() == "Finish"
    qtbot.waitUntil(lambda: bool(server.latest), timeout=120_000)  # serving
    server.run_button.setChecked(False)
    qtbot.waitUntil(lambda: server.worker is None, timeout=10000)
    tour.next()
    assert not tour.isVisible()
    # Finish leaves nothing the tour started open or running
    assert not any(w.isVisible() for w in (ab, seqs, server)) and server.worker is None
    assert not ab.runner.busy and not seqs.busy


def test_pagevis_tour_starts_the_tour(monkeypatch):
    import pagevis.gui
    from pagevis.cli.main import main

    calls = []
    monkeypatch.setattr(pagevis.gui, "launch", lambda **kwargs: calls.append(kwargs) or 0)
    assert main(["--tour"]) == 0 and calls[-1]["tour"] is True
    assert main([]) == 0 and "tour" not in calls[-1]


def test_the_tour_window_fits_its_text(qtbot, window):
    from clipping import clipped_texts

    tour = window.start_tour()
    qtbot.addWidget(tour)
    qtbot.addWidget(window.ab_window)
    assert clipped_texts(tour) == [] and tour.isVisible()
    tour.activateWindow()
    qtbot.waitUntil(tour.isActiveWindow, timeout=3000)
    qtbot.keyClick(tour, Qt.Key_Escape)
    qtbot.waitUntil(lambda: not tour.isVisible(), timeout=3000)

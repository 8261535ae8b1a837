"""The eviction events table with "selected layer only": its newest rows are the chosen layer's, up to the shown step
(the newest rows of every layer, then filtered, left a handful of the chosen layer's)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import make_window  # noqa: E402

from pagevis.gui.widgets import events  # noqa: E402


def test_selected_layer_only_keeps_every_row_of_the_layer_up_to_the_shown_step(qtbot, tmp_path, monkeypatch):
    monkeypatch.setattr(events, "MAX_ROWS", 10)  # 2 layers, one eviction each per step: 20 rows in 10 steps
    window = make_window(qtbot, tmp_path)
    window.runner.step_blocking(14)  # a prefill, then 13 steps that evict in both layers
    window.controls.layer.setValue(1)
    window.scrub(12)
    window.redraw()
    timeline = window.timeline
    wanted = [e for e in timeline.evictions if e.layer == 1 and e.step <= 12][-10:]
    shown = window.events.visible_rows()
    assert len(wanted) == 10 and len(shown) == 10
    assert shown == [(e.step, e.layer, e.page, e.slot, e.position, e.token, e.reason, e.score) for e in wanted]
    window.events.only_layer.setChecked(False)  # every layer: the newest 10 of both
    assert [row[0] for row in window.events.visible_rows()] == [e.step for e in timeline.evictions
                                                                if e.step <= 12][-10:]

"""The app with a disk tier: the page grid's disk strip and tiered block table, the metrics' tier curves,
the controls' validation, and records rebuilt from the timeline's spill file with their tier state."""

import numpy as np
import pytest

from gui_helpers import PROMPT, SYNTH, make_window, step
from pagevis.engine import DecodeSession, SessionConfig
from pagevis.viewmodel.timeline import Timeline, SessionInfo
from pagevis.viewmodel.cells import DISK_STATES
from pagevis.trace import record_differences

TIERED = SessionConfig(page_size=4, max_pages=3, disk_pages=10, policy="sinks", select="quest", select_pages=2,
                       max_new_tokens=60, chat=False, oracle=True)


@pytest.fixture
def window(qtbot, tmp_path):
    return make_window(qtbot, tmp_path, config=TIERED)


def test_disk_strip_block_table_and_metrics_show_the_tiers(qtbot, window, tmp_path):
    step(qtbot, window, 12)
    record = window.timeline.records[-1]
    grid = window.page_grid
    assert grid.disk.isVisible() and len(grid.disk_states) == 10
    table = record.block_tables[0]
    in_ram = {p for p, f in zip(table, record.tiers.block_frames[0]) if f >= 0}
    for page in range(10):  # every page's state in the strip is what the record says
        state = DISK_STATES[grid.disk_states[page]]
        if page not in table:
            assert state == "free"
        elif state not in ("read from disk this step", "swapped out this step"):
            assert state == ("in RAM" if page in in_ram else "on disk")
    rows = grid.blocks.rows
    assert len(rows) == len(table) and any(r[1].startswith("disk ·") for r in rows)
    assert all(r[1].startswith(f"RAM {f} ·") for r, f in zip(rows, record.tiers.block_frames[0]) if f >= 0)
    disk_page = next(p for p, f in zip(table, record.tiers.block_frames[0]) if f < 0)
    held = record.page_map(0)[disk_page]
    assert f"holds {(held >= 0).sum()} tokens" in grid.disk_info(disk_page)
    metrics = window.metrics
    assert metrics.tiers.isVisible()
    hit_rate = metrics.data["hit_rate"]
    assert np.isfinite(hit_rate).all() and ((0 <= hit_rate) & (hit_rate <= 1)).all()
    assert metrics.data["faults"].sum() > 0
    window.grab().save(str(tmp_path / "tiers.png"))


def test_disk_controls_are_validated_like_the_others(qtbot, window):
    controls = window.controls
    timeline = window.timeline
    controls.max_pages.setValue(1)  # a disk tier needs a RAM frame to read into
    assert not controls.check()
    assert "max_pages = 1" in controls.error.text() and "disk tier" in controls.error.text()
    qtbot.wait(300)
    assert window.timeline is timeline  # nothing restarted
    controls.max_pages.setValue(3)
    assert controls.check()
    assert controls.session_config().disk_pages == 10 and controls.session_config().select == "quest"


def test_spilled_tiered_records_come_back_whole():
    session = DecodeSession(SYNTH.load(), PROMPT, TIERED)
    records = [session.step() for _ in range(30)]
    timeline = Timeline(SessionInfo("synthetic", PROMPT, session.prompt_ids, TIERED, 2, 4, 0), session.token_text)
    timeline.extend(records)
    for index in (0, 5, 17):  # rebuilt from the spill file
        assert record_differences(timeline.records[index], records[index]) == []
    session.cache.close()


def test_the_capacity_line_is_the_disk_tiers_from_the_first_frame_on(qtbot, window):
    """One formula (config.capacity: disk pages × page size with a disk tier) before the first step and after:
    the line no longer jumps from the RAM frames' 12 tokens to the tier's 40 at the first step."""
    window.docks["Metrics"].raise_()
    window.redraw()
    assert window.timeline is not None and not len(window.timeline)
    assert window.metrics.capacity.value() == TIERED.capacity == 40
    step(qtbot, window)
    assert window.metrics.capacity.value() == 40

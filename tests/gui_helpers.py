"""Shared by the GUI tests: a window driven for real (offscreen) on the synthetic model, with private settings.

The synthetic model uses a byte tokenizer, so the prompt "hello paged world" is 17 tokens and a 4 × 4 cache
holds 16 of them: the first step is a 16-token prefill, the second evicts.
"""

from __future__ import annotations

from PySide6.QtCore import QSettings

from pagevis.engine import ModelSpec, SessionConfig

SYNTH = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
PROMPT = "hello paged world"  # 17 byte tokens
CONFIG = SessionConfig(page_size=4, max_pages=4, policy="sinks", max_new_tokens=60, chat=False)


def make_window(qtbot, tmp_path, spec=SYNTH, prompt=PROMPT, config=CONFIG, restore=False):
    from pagevis.gui.session.window import MainWindow

    settings = QSettings(str(tmp_path / "gui.ini"), QSettings.IniFormat)
    window = MainWindow(settings=settings, restore=restore)
    qtbot.addWidget(window)
    window.apply_arguments(spec, prompt, config)
    window.resize(1400, 900)
    window.show()
    window.start()
    # a hang guard: the first session of a process may compile numba kernels (10-25 s each at load 6 on 2 cores)
    qtbot.waitUntil(lambda: window.runner.state == "ready", timeout=120_000)
    return window


def write_synthetic_trace(tmp_path, steps: int):
    """A trace of `steps` steps of the small synthetic session, written to tmp_path: its path and the session."""
    from pagevis.engine import DecodeSession
    from pagevis.trace import write_trace

    session = DecodeSession(SYNTH.load(), PROMPT, CONFIG)
    for _ in range(steps):
        session.step()
    path = tmp_path / "run.pvtrace"
    write_trace(path, session, model_spec=SYNTH)
    return path, session


# A hang guard, not a speed test: one SmolLM2 step on a 2-core machine at load 10 (eight sessions sharing it) took
# over 30 s once (test_smollm2_loads_without_freezing_and_decodes, make test-all)
STEP_GUARD_MS = 120_000


def step(qtbot, window, n: int = 1) -> None:
    """Decode n tokens (from the newest record: → while scrubbed back only moves forward)."""
    for _ in range(n):
        count = len(window.timeline)
        if count:
            window.scrub(count - 1)
        window.step()
        qtbot.waitUntil(lambda: not window.runner.busy and len(window.timeline) == count + 1, timeout=STEP_GUARD_MS)
    window.redraw()


def restart_by(qtbot, window, change):
    """Call `change` (a control edit or a reset) and wait until the window has restarted on a new timeline;
    return the old timeline."""
    old = window.timeline
    change()
    qtbot.waitUntil(lambda: window.timeline is not old and window.runner.state == "ready", timeout=5000)
    return old

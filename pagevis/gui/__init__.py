"""pagevis.gui: the desktop app. The only package of pagevis that imports Qt."""

from __future__ import annotations

import os
import sys
import time

from pagevis import platform_check
from pagevis.engine import ModelSpec, SessionConfig
from pagevis.gui.teardown import windows_deleted_on_return

ORGANIZATION = "pagevis"
APPLICATION = "pagevis"


def _application():
    from PySide6.QtWidgets import QApplication

    from pagevis.gui.widgets import gui_gc, theme

    app = QApplication.instance()
    if app is None:
        app = QApplication(sys.argv[:1])
        app.setOrganizationName(ORGANIZATION)
        app.setApplicationName(APPLICATION)
        app.setApplicationDisplayName("pagevis")
        theme.apply(app)
    else:
        theme.configure_pyqtgraph()
    gui_gc.install(app)  # cyclic garbage collected on this thread only: never a Qt object on a worker's
    return app


@windows_deleted_on_return
def launch(model_spec: ModelSpec | None = None, prompt: str | None = None, session_config: SessionConfig | None = None,
           screenshot: str | None = None, steps: int = 0, trace: str | None = None, metrics=None,
           preset=None, recording=None, tour: bool = False, present: bool | None = None) -> int:
    """Open the main window (QApplication created here). With `screenshot`, open offscreen-capable, decode `steps`
    steps (synchronously), save a PNG of the whole window to that path and return 0 without entering the event
    loop. With `trace`, open that trace for replay. With `metrics` (a pagevis.observe.Metrics), every session
    the window starts feeds it. With an A/B `preset` (pagevis.presets), the A/B window opens on its two
    configurations (and is what a screenshot shows). With `recording` (a pagevis.gui.video_frames.Request), record
    the window (or one view) to a video instead: `steps` decoded steps, or every step of `trace`. With `tour`,
    Help ▸ Tour starts at once. `present`: the presentation layout (True) or the normal one (False); None: the
    window's own choice (presentation on a real display at most 1366 px wide). Returns the exit code."""
    from pagevis.gui.startup import probe_from_environment

    probe = probe_from_environment(time.time())  # `pagevis bench startup` times the phases below
    if (screenshot or recording) and "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # a screenshot needs no screen and should not flash one
    verdict = platform_check.check()
    if not verdict.ok:  # say what to install, before Qt aborts the process with "could not load the plugin"
        print(verdict.message(), file=sys.stderr)
        return platform_check.EXIT_STATUS
    app = _application()
    if screenshot or recording:
        quiet_size_hints()
    probe and probe.mark("qt")
    from pagevis.gui.session.window import MainWindow

    _one_blas_thread()
    # A screenshot is a pure function of its arguments: it neither reads nor writes the user's settings.
    headless = bool(screenshot or recording)
    window = MainWindow(restore=not headless, persist=not headless)
    ab = preset if preset is not None and preset.b is not None else None
    if ab is not None:  # an A/B preset is the A/B window's session: the main window keeps its own settings
        session_config = None if session_config == ab.a else session_config
        prompt = None if prompt == ab.prompt_text() else prompt
    given = model_spec is not None or prompt is not None or session_config is not None
    window.apply_arguments(model_spec, prompt, session_config)
    if present is not None:
        window.set_presentation(present)
    if preset is not None and ab is None:
        window.presets.announce(preset)
    window.start_note = start_note(window, preset, given)
    if probe is not None:
        probe.mark("window")
        probe.watch(app, window)
    if metrics is not None:
        _observe_sessions(window.runner, metrics)
    if recording is not None:
        from pagevis.gui.video_frames import record_from_launch

        return record_from_launch(app, window, recording, steps, trace, ab)
    if screenshot:
        return _screenshot(app, window, screenshot, steps, ab)
    window.show()
    if not (trace and window.open_trace(trace)):
        window.start()
    if ab is not None:
        window.open_ab(ab.a, ab.b, window.controls.prompt(), title=ab.name, play=True, text=ab.text)
    if tour:
        window.start_tour()
    code = app.exec()
    if window.isVisible():  # the loop ended without the window closing (app.quit): stop the decoder all the same
        window.close()
    return code


def start_note(window, preset, given: bool) -> str:
    """What the status bar says once the first session is ready: whose settings the window opened with."""
    if preset is not None and preset.b is None:
        return f"{preset.name}: a preset's session, not saved"
    if given:
        return "Opened with the command line's settings"
    if window.restored_config:
        return "Restored your last settings · Demo ▸ Default resets them"
    return "The default settings (README) · Demo ▸ presets for the other demos"


@windows_deleted_on_return
def launch_server(model_spec: ModelSpec | None = None, preset=None, screenshot: str | None = None,
                  steps: int = 0, recording=None) -> int:
    """Open the Server window alone (`pagevis --server-demo`) on `model_spec` (default SmolLM2) with a server
    preset (pagevis.presets.SERVER_PRESETS; default the first). With `screenshot`: offscreen unless a platform
    is set, `steps` real engine steps, a PNG of the window, exit code 0; with `recording` (a
    pagevis.gui.video_frames.Request), those steps to a video, one frame per step."""
    if (screenshot or recording) and "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    verdict = platform_check.check()
    if not verdict.ok:
        print(verdict.message(), file=sys.stderr)
        return platform_check.EXIT_STATUS
    app = _application()
    _one_blas_thread()
    from pagevis.gui.server.window import server_demo

    return server_demo(app, model_spec or ModelSpec(), preset, screenshot, steps, recording)


@windows_deleted_on_return
def launch_attached_server(model_spec: ModelSpec | None, events: str | None, metrics_url: str | None) -> int:
    """The Server window attached to a running `pagevis serve` (its KV events, its /metrics); pages' text with
    the model's tokenizer (SmolLM2's by default)."""
    verdict = platform_check.check()
    if not verdict.ok:
        print(verdict.message(), file=sys.stderr)
        return platform_check.EXIT_STATUS
    app = _application()
    window = attached_server_window(model_spec, events, metrics_url)
    window.show()
    return app.exec()


def attached_server_window(model_spec: ModelSpec | None, events: str | None, metrics_url: str | None):
    """The attached Server window, at most its screen's size and wholly on it (it opened at 1600 × 1000, cut
    off on a 1280 × 720 screen)."""
    from pagevis.gui.server.attached import AttachedServerWindow, detokenizer_for
    from pagevis.gui.widgets.windows import place_beside

    window = AttachedServerWindow(events, metrics_url, detokenizer_for(model_spec or ModelSpec()))
    place_beside(window, None, steps=0)
    return window


def quiet_size_hints() -> None:
    """Drop Qt's "This plugin does not support propagateSizeHints()" (the offscreen platform says it for every
    window and dock resized: 9 lines per headless recording, none of them the user's concern); every other Qt
    message goes where it went before."""
    from PySide6.QtCore import qInstallMessageHandler

    previous = None

    def handler(mode, context, message) -> None:
        if "propagateSizeHints" in message:
            return
        if previous is not None:
            previous(mode, context, message)
        else:
            print(message, file=sys.stderr)

    previous = qInstallMessageHandler(handler)


def _observe_sessions(runner, metrics) -> None:
    """Subscribe `metrics` to each new session (before its first step); the old session's observer goes."""
    current = []

    def started(_timeline) -> None:
        while current:
            current.pop().close()
        if runner.session is not None:
            current.append(metrics.observe(runner.session))

    runner.started.connect(started)


def _one_blas_thread() -> None:
    """Decoding is memory-bound and the UI thread needs a core: OpenBLAS threads spinning for a busy core
    slow decoding several times (see pagevis.model.blas_threads)."""
    try:
        from pagevis.model import set_blas_threads
    except ImportError:
        return
    set_blas_threads(1)


def _screenshot(app, window, path: str, steps: int, ab=None) -> int:
    """Offscreen: the window at the fixed default size, rendered by Qt. On a real display (xcb, wayland):
    the window as it opens on that screen, read back from the display server once it has been painted."""
    window = open_for_picture(app, window, ab, "the screenshot")
    if window is None:
        return 1
    window.runner.step_blocking(steps)
    app.processEvents()
    window.redraw()
    app.processEvents()
    return save_screenshot(app, window, path)


def open_for_picture(app, window, ab=None, purpose: str = "the screenshot", trace: str | None = None):
    """The window shown at the default size (offscreen) or as it opens (on a display), its session started
    (or `trace` opened) on this thread; the A/B window on `ab`'s two configurations instead when given. None
    (said on stderr, the window closed) when no session could start."""
    from PySide6.QtCore import Qt

    from pagevis.gui.widgets.export import default_size

    real_display = app.platformName() not in ("offscreen", "minimal")
    if not real_display:
        window.setWindowState(window.windowState() & ~Qt.WindowMaximized)  # (a small screen maximizes it)
        window.resize(default_size())
        window.size_docks()
    window.show()
    app.processEvents()
    if trace is not None:
        if window.open_trace(trace):
            return window
        return _refuse(window, f"could not open {trace}")
    window.start(blocking=True)
    if window.runner.session is None:
        return _refuse(window, f"could not start a session for {purpose}")
    if ab is not None:  # the A/B window is the picture: two sessions in lockstep
        window = window.open_ab(ab.a, ab.b, window.controls.prompt(), title=ab.name, blocking=True, text=ab.text)
        if not real_display:
            window.resize(default_size())
    return window


def _refuse(window, fallback: str) -> None:
    """Say on stderr why the window has nothing to show (the last line its messages hold, else `fallback`) and
    close it."""
    said = window.messages.toPlainText().strip().splitlines()
    last = said[-1].split("] ", 1)[-1] if said else fallback  # without the line's [hh:mm:ss]
    print(f"pagevis: {last}", file=sys.stderr)
    window.close()
    return None


def save_screenshot(app, window, path: str) -> int:
    """Save a PNG of the window and close it: 0, or 1 (said on stderr) when the file cannot be written."""
    # X11 lets a client read the screen back; Wayland does not (a client sees only its own buffers)
    image = _grab_from_screen(app, window) if app.platformName() == "xcb" else window.grab()
    ok = image.save(path)
    window.close()
    if not ok:
        print(f"pagevis: could not write {path}", file=sys.stderr)
        return 1
    return 0


def _grab_from_screen(app, window):
    """The window's pixels as the display server holds them (on X11, an xcb GetImage of the window): proof
    that the window really is on that screen, not only rendered by Qt."""
    import time

    deadline = time.monotonic() + 10
    handle = window.windowHandle()
    while not (handle is not None and handle.isExposed()) and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.01)
    window.repaint()
    settle = time.monotonic() + 0.5  # let the backing store reach the server before reading it back
    while time.monotonic() < settle:
        app.processEvents()
        time.sleep(0.01)
    return window.screen().grabWindow(window.winId())

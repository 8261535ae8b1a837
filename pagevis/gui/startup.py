"""Where the app's startup time goes (`pagevis bench startup`). With PAGEVIS_STARTUP_PROBE=FILE in its
environment, `pagevis` notes when each phase of its start ends, in seconds since PAGEVIS_STARTUP_T0 (the
launcher's time.time() just before it spawned the process), writes them to FILE as one JSON object and quits
once the ready session's first frame has been painted:

  launch       the interpreter started, pagevis's command line imported and parsed (pagevis.gui.launch runs)
  qt           PySide6 imported and the QApplication created
  window       the main window built (its modules and pyqtgraph imported, every view constructed)
  first_paint  the first paint event of any widget: the first drawn frame (SmolLM2 still loading)
  ready        the model loaded and the session started (the prompt tokenized, the cache allocated; a small
               model can be ready before the first paint)
  ready_drawn  the first paint after the views show the ready session

The file also holds what the window showed when ready ("window": the status bar's message, the preset banner's
text or "", the configuration's policy and cache, whether an A/B window is open), so a rehearsal can check which
settings a launch opened with (scripts/xvfb_smoke.py). With PAGEVIS_STARTUP_PROBE_LINGER=SECONDS the app runs
that long after ready before it closes (as a user closes it: settings saved), and "closing" holds the same at
that moment.
"""

from __future__ import annotations

import json
import os
import time

ENV_FILE, ENV_T0, ENV_LINGER = "PAGEVIS_STARTUP_PROBE", "PAGEVIS_STARTUP_T0", "PAGEVIS_STARTUP_PROBE_LINGER"
PHASES = ("launch", "qt", "window", "first_paint", "ready", "ready_drawn")


class StartupProbe:
    def __init__(self, path: str, t0: float):
        self.path, self.t0 = path, t0
        self.marks: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # the process's CPU seconds (all threads) at each mark: less noisy when
        self._filter = None  # other processes share the cores
        self.shown: dict[str, dict] = {}  # what the window showed: "window" (when ready), "closing"
        self.linger_s = float(os.environ.get(ENV_LINGER) or 0)

    def mark(self, phase: str) -> None:
        if phase not in self.marks:
            self.marks[phase] = time.time() - self.t0
            self.cpu[phase] = time.process_time()

    def watch(self, app, window) -> None:
        """Mark the first paint, the session's readiness and the paint after it; then write and quit."""
        from PySide6.QtCore import QEvent, QObject, QTimer

        probe = self

        class PaintFilter(QObject):
            def eventFilter(self, obj, event):  # noqa: N802 - Qt's name
                if event.type() == QEvent.Paint:
                    probe.mark("first_paint")
                    if "ready" in probe.marks and "ready_drawn" not in probe.marks:
                        probe.mark("ready_drawn")
                        probe.shown["window"] = shown(window)
                        probe.write()
                        # Close as a user would, after this paint: quitting inside it skips closeEvent, so the
                        # decoder thread outlived the app and the process crashed on exit (exit -11 under load).
                        QTimer.singleShot(int(probe.linger_s * 1000), close)
                return False

        def close() -> None:
            if self.linger_s:
                self.shown["closing"] = shown(window)
                self.write()
            window.close()

        def state_changed(state: str) -> None:
            if state in ("ready", "error"):
                self.mark("ready")
                window.redraw()

        self._filter = PaintFilter()
        app.installEventFilter(self._filter)
        window.runner.state_changed.connect(state_changed)

    def write(self) -> None:
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump({"phases": self.marks, "cpu": self.cpu, **self.shown}, handle)


def shown(window) -> dict:
    """What the main window shows: its status message, its preset banner's text ("" when hidden), its
    configuration's policy and cache, and whether an A/B window is open (and its steps)."""
    banner = window.presets.banner
    try:
        config = window.controls.session_config()
        cache = {"policy": config.policy, "page_size": config.page_size, "max_pages": config.max_pages}
    except Exception as error:  # noqa: BLE001 - a probe reports what it finds, it never stops the app
        cache = {"error": str(error)}
    ab = window.ab_window
    return {"status": window.statusBar().currentMessage(),
            "banner": banner.label.text() if banner.isVisible() else "", **cache,
            "ab_window": ab is not None and ab.isVisible(),
            "ab_steps": len(ab.timeline) if ab is not None and ab.timeline is not None else 0}


def probe_from_environment(started: float) -> StartupProbe | None:
    """The probe the environment asks for (None without one); `started` is the time.time() of launch's start."""
    path, t0 = os.environ.get(ENV_FILE), os.environ.get(ENV_T0)
    if not path or not t0:
        return None
    probe = StartupProbe(path, float(t0))
    probe.marks["launch"] = started - probe.t0
    probe.cpu["launch"] = time.process_time()
    return probe

"""What a frame costs the window while decoding: a frame changes the narration, the transport's step and the status
bar's step and speed, and none of that lays the main window out again (a relayout repainted every dock)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QEvent, QObject  # noqa: E402

from gui_helpers import step  # noqa: E402


class LayoutRequests(QObject):
    """Counts the layout requests the main window receives."""

    def __init__(self, window):
        super().__init__()
        self.window, self.count = window, 0
        window.installEventFilter(self)

    def eventFilter(self, watched, event):
        if watched is self.window and event.type() == QEvent.LayoutRequest:
            self.count += 1
        return False


def test_frames_whose_texts_change_do_not_lay_the_main_window_out(qtbot, window):
    step(qtbot, window, 12)
    qtbot.wait(20)
    requests = LayoutRequests(window)
    narrations = set()
    for index in (3, 9, 11, 10, 5, 11):  # each frame a new step: its narration, transport and status texts change
        window.scrub(index)
        qtbot.wait(5)
        narrations.add(window.narration.text())
        assert window.transport.position.text().startswith(f"step {index} / 11")
        assert window.status_step.text().startswith(f"step {index}:")
    assert len(narrations) == 5 and requests.count == 0
    # the texts are whole: each label as wide as its text (the narration: the window's width)
    for label in (window.transport.position, window.status_step, window.status_speed):
        assert label.width() >= label.sizeHint().width() and label.isVisible()
    assert window.narration.width() >= window.width() - 40


def test_a_new_session_gives_the_status_bar_its_room_back(qtbot, window):
    step(qtbot, window, 2)
    wide = window.status_step.holder.width()
    window.restart("reset", blocking=True)
    qtbot.waitUntil(lambda: window.status_step.text() == "step —")
    qtbot.waitUntil(lambda: window.status_step.holder.width() < wide)


def test_the_pace_keeps_the_ui_threads_cpu_a_share_of_the_decoders(window, monkeypatch):
    from pagevis.gui.session import rendering

    renderer = window.renderer
    clock = {"perf_counter": 100.0, "thread_time": 10.0, "process_time": 50.0}
    for name in clock:
        monkeypatch.setattr(rendering.time, name, lambda name=name: clock[name])
    renderer._cpu_mark, renderer.frames = (100.0, 10.0, 50.0, 0), 0
    # 0.5 s: the UI thread used 0.02 s over 4 frames, the decoder 0.4 s -> 5 ms a frame against 0.06 * 0.8 s a second
    clock.update(perf_counter=100.5, thread_time=10.02, process_time=50.42)
    renderer.frames = 4
    expected = 0.005 / (rendering.UI_SHARE * 0.4 / 0.5)
    assert renderer._pace() == pytest.approx(expected)
    assert window.runner.hand_every == pytest.approx(expected / 2)
    # a frame costing 50 ms: the slowest pace, 5 frames a second; a cheap one: at most 30
    clock.update(perf_counter=101.0, thread_time=10.22, process_time=50.82)
    renderer.frames = 8
    assert renderer._pace() == rendering.MAX_FRAME_INTERVAL
    clock.update(perf_counter=101.5, thread_time=10.2201, process_time=51.2201)
    renderer.frames = 12
    assert renderer._pace() == rendering.FRAME_INTERVAL
    # after a pause (a mark older than a second) the pace stays and a new measure starts
    clock.update(perf_counter=110.0, thread_time=10.3, process_time=51.3)
    assert renderer._pace() == rendering.FRAME_INTERVAL and renderer._cpu_mark == (110.0, 10.3, 51.3, 12)


def test_coalesced_frames_lose_no_step_and_the_last_step_is_drawn(qtbot, window, monkeypatch):
    from pagevis.gui.session import rendering

    arrivals, shown = [], {}
    window.runner.records.connect(lambda records: arrivals.append(len(records)))
    for view in window.views:  # what each view was last asked to show
        def show(state, view=view, draw=view.show_state):
            shown[view.title] = state.index
            draw(state)
        monkeypatch.setattr(view, "show_state", show)
    monkeypatch.setattr(window.renderer, "_pace", lambda: rendering.MAX_FRAME_INTERVAL)  # 5 frames a second
    window.runner.hand_every = 60.0  # one hand-off for the whole run, as a slow UI would get
    frames, start = window.renderer.frames, len(window.timeline)
    window.runner.step(25)
    qtbot.waitUntil(lambda: not window.runner.busy, timeout=120_000)
    qtbot.waitUntil(lambda: window.index == len(window.timeline) - 1)
    assert arrivals == [25] and len(window.timeline) - start == 25 == len(window.runner.session.records) - start
    assert [r.step for r in window.timeline.records] == list(range(len(window.timeline)))
    last = len(window.timeline) - 1
    # every view shows the last step, the slow ones too once decoding stopped (the frame pending then)
    drawn = [view.title for view in window.views if window.renderer._shown(view)]
    assert len(drawn) >= 5
    qtbot.waitUntil(lambda: all(shown.get(title) == last for title in drawn), timeout=2000)
    assert window.renderer.frames - frames <= 3  # not one a step
    assert window.transport.position.text().startswith(f"step {last} / {last}")
    assert window.status_step.text().startswith(f"step {last}:")


def test_pausing_at_max_speed_shows_the_exact_step_paused_at(qtbot, window, monkeypatch):
    shown = {}
    for view in window.views:
        def show(state, view=view, draw=view.show_state):
            shown[view.title] = state.index
            draw(state)
        monkeypatch.setattr(view, "show_state", show)
    window.toggle_play()  # max speed: frames paced, records handed over in batches
    qtbot.waitUntil(lambda: len(window.timeline) >= 10, timeout=120_000)
    window.toggle_play()
    qtbot.waitUntil(lambda: not window.runner.busy, timeout=120_000)
    last = len(window.timeline) - 1
    assert last == len(window.runner.session.records) - 1 and window.runner.state == "ready"
    drawn = [view.title for view in window.views if window.renderer._shown(view)]
    qtbot.waitUntil(lambda: all(shown.get(title) == last for title in drawn), timeout=2000)
    assert window.index == last and window.transport.position.text().startswith(f"step {last} / {last}")
    assert window.narration.text().startswith(f"step {last}:")


def test_the_worker_pauses_only_after_a_step_that_took_little_cpu(monkeypatch):
    """A mostly-Python step (the synthetic model's) leaves the GIL to the UI thread for a moment; a step of a real
    model's length does not pause, however long it took by the wall clock (SmolLM2's paused 2 ms in every ~10)."""
    import time

    from pagevis.engine import RunControl
    from pagevis.gui.session import runner

    sleeps = []
    monkeypatch.setattr(runner.time, "sleep", sleeps.append)

    class Stepper:
        done = False

        def __init__(self, cpu: float):
            self.cpu = cpu

        def step(self):
            started = time.thread_time()
            while time.thread_time() - started < self.cpu:
                pass
            return "record"

    for cpu, pauses in ((0.0, [runner.GIL_BREATH] * 3), (2 * runner.SHORT_STEP, [])):
        sleeps.clear()
        batches = list(runner.worker_steps(Stepper(cpu), RunControl(budget=3), flush_every=0.0))
        assert batches == [["record"]] * 3 and sleeps == pauses


def test_the_gui_bench_splits_a_steps_wall_time_into_cpu_waiting_and_blocked():
    """A step that sleeps (as a thread waiting for the GIL does) shows as blocked, one that computes as CPU."""
    import os
    import time

    from pagevis.bench.gui.app import StepClock

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("the run-queue wait is read from Linux's /proc/thread-self/schedstat")

    class Session:
        def __init__(self, sleep: bool):
            self.sleep = sleep

        def step(self):
            started = time.thread_time()
            if self.sleep:
                time.sleep(0.02)
            while not self.sleep and time.thread_time() - started < 0.02:
                pass
            return "record"

    for sleep in (True, False):
        clock, session = StepClock(), Session(sleep)
        clock.install(session)
        assert [session.step() for _ in range(3)] == ["record"] * 3
        split = clock.split()
        assert split["wall"] == pytest.approx(split["cpu"] + split["waiting"] + split["blocked"])
        assert (split["blocked"] if sleep else split["cpu"]) >= 19
        assert (split["cpu"] if sleep else split["blocked"]) < 5

"""Recordings (pagevis.export.video, pagevis.gui.video_frames): every written file is decoded back — frame count,
size, frames that differ — and the captions are compared with the narration of the same records; bad targets
are one-line errors. The windows are driven for real (offscreen) on the small synthetic model."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pagevis.cli.main import main
from pagevis.export.video import CaptionTrack, RecordingError, changed_box, check_target, open_video

imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="recording needs pagevis[record] (imageio-ffmpeg)")
Image = pytest.importorskip("PIL.Image", reason="GIF recording needs pagevis[record] (Pillow)")


def decode(path):
    """Every frame of a video file as (height, width, 3) uint8, read with ffmpeg (MP4, WebM) or Pillow (GIF)."""
    if str(path).endswith(".gif"):
        image = Image.open(path)
        frames = []
        for i in range(image.n_frames):
            image.seek(i)
            frames.append(np.asarray(image.convert("RGB")))
        return frames
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    return [np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]


def moving_square(i: int, size=(120, 90)) -> np.ndarray:
    frame = np.full((size[1], size[0], 3), 40, np.uint8)
    frame[20:44, 8 * i:8 * i + 24] = (230, 60, 40)
    return frame


@pytest.mark.parametrize("suffix", [".mp4", ".webm", ".gif"])
def test_frames_decode_back_with_their_count_size_and_content(tmp_path, suffix):
    path = tmp_path / f"clip{suffix}"
    writer = open_video(str(path), fps=12)
    for i in range(9):
        writer.add(moving_square(i, (121, 91)), f"step {i // 3}")  # odd sizes: padded to even for yuv420p
    writer.close()
    frames = decode(path)
    assert len(frames) == 9
    assert frames[0].shape == (92, 122, 3)
    for i, frame in enumerate(frames):  # the square is where frame i put it (lossy codecs: within a margin)
        assert np.abs(frame[32, 8 * i + 12].astype(int) - (230, 60, 40)).max() < 40
        assert np.abs(frame[70, 60].astype(int) - 40).max() < 25
    assert all(np.abs(a.astype(int) - b).mean() > 1 for a, b in zip(frames, frames[1:]))
    sidecar = {".mp4": ".srt", ".webm": ".vtt"}.get(suffix)
    if sidecar is None:  # a GIF of few colours is exact: each frame's unchanged pixels show the previous one's
        assert all(np.array_equal(f[:91, :121], moving_square(i, (121, 91))) for i, f in enumerate(frames))
        assert not list(tmp_path.glob("clip.*t"))
        return
    text = path.with_suffix(sidecar).read_text()
    if sidecar == ".vtt":
        assert text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:00.250\nstep 0\n")
    else:
        assert text.startswith("1\n00:00:00,000 --> 00:00:00,250\nstep 0\n\n2\n00:00:00,250 --> 00:00:00,500\nstep 1")
    assert text.count("-->") == 3


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_memory_does_not_grow_with_the_number_of_frames(tmp_path, suffix):
    import tracemalloc

    def peak(frames: int) -> int:
        tracemalloc.start()
        writer = open_video(str(tmp_path / f"n{frames}{suffix}"), fps=30)
        for i in range(frames):
            writer.add(moving_square(i % 14, (160, 120)), f"step {i}")
        writer.close()
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    frame_bytes = 160 * 120 * 3
    peak(5)  # one-off allocations (the encoder's imports and caches) out of the way
    few, many = peak(30), peak(150)  # both wrap the square round (a frame-wide change: the largest GIF frame)
    # holding the frames would add 120 frames (6.9 MB); a bounded writer's peaks differ by allocator noise
    assert many < few + 16 * frame_bytes and many < 40 * frame_bytes


def test_caption_cues_merge_repeats_and_skip_empty_lines(tmp_path):
    track = CaptionTrack(str(tmp_path / "c.srt"), fps=4)
    for i, line in enumerate(["a", "a", "", "b  c", "b c"]):
        track.add(i, line)
    track.close(5)
    assert (tmp_path / "c.srt").read_text() == ("1\n00:00:00,000 --> 00:00:00,500\na\n\n"
                                                "2\n00:00:00,750 --> 00:00:01,250\nb c\n\n")


def test_changed_box_is_the_smallest_rectangle_around_the_changes():
    a = np.zeros((10, 20, 3), np.uint8)
    b = a.copy()
    b[3, 5] = 1
    b[7, 12, 2] = 9
    assert changed_box(None, a) == (0, 0, 20, 10)
    assert changed_box(a, a) is None
    assert changed_box(a, b) == (5, 3, 13, 8)


@pytest.mark.parametrize("name, message", [("clip.avi", "unknown video format '.avi'"),
                                           ("clip", "unknown video format '(no extension)'")])
def test_an_unknown_extension_is_refused(name, message):
    with pytest.raises(RecordingError, match=re.escape(message)):
        check_target(name)


@pytest.mark.parametrize("argv, message", [
    (["--record", "out.avi", "--steps", "3"], "out.avi: unknown video format '.avi'; give a name ending in .mp4"),
    (["--record", "/no/such/folder/out.mp4", "--steps", "3"], "--record /no/such/folder/out.mp4: no such folder"),
    (["--record", "out.mp4"], "--record: give the number of steps to record with --steps N"),
    (["--record", "out.mp4", "--steps", "3", "--fps", "500"], "--fps 500.0: must be from 1 to 60"),
    (["--record-view", "text"], "--record-view, --record-width and --no-caption go with --record FILE"),
    (["--server-demo", "--record", "s.mp4", "--steps", "3", "--record-view", "text"],
     "--record-view records a view of the main window, not of the Server window"),
    (["--record", "out.gif", "--steps", "3", "--record-width", "10"], "--record-width 10: must be from 160 to 8192"),
])
def test_bad_recording_arguments_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_replay_record_refuses_an_unwritable_path_before_qt(capsys, tmp_path):
    from tests.gui_helpers import write_synthetic_trace

    trace, _ = write_synthetic_trace(tmp_path, 2)
    folder = tmp_path / "locked.mp4"
    folder.mkdir()
    assert main(["replay", str(trace), "--record", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is a folder" in err and err.count("\n") == 1


# --- the windows ------------------------------------------------------------------------------------------

@pytest.mark.slow  # decodes as it records (2-3 s on a quiet 2-core machine, more under load)
def test_main_window_recording_is_every_step_with_its_narration(qtbot, tmp_path):
    from PySide6.QtCore import Qt

    from pagevis.gui.video_frames import record, timeline_scene
    from pagevis.viewmodel.narration import narrate
    from tests.gui_helpers import make_window

    window = make_window(qtbot, tmp_path)
    # the offscreen screen is 800 px, so the window opens maximized and widens as its content's minimum grows;
    # at the size gui_helpers asks for it keeps one size, which every frame must have
    window.setWindowState(window.windowState() & ~Qt.WindowMaximized)
    window.resize(1400, 900)
    qtbot.wait(50)
    path = tmp_path / "live.mp4"
    seen = []
    result = record(timeline_scene(window, frames=6, decode=True), str(path), fps=5,
                    progress=lambda done, total: seen.append((done, total)))
    assert len(window.timeline) == 6 and result.frames == 6 and seen[-1] == (6, 6)
    frames = decode(path)
    assert len(frames) == 6
    width, height = window.width(), window.height()
    # the window's own narration line is in the frame: no caption strip below it (the subtitles file has it)
    assert frames[0].shape[1] == width + width % 2 and frames[0].shape[0] == height + height % 2
    assert all(np.abs(a.astype(int) - b).mean() > 0.05 for a, b in zip(frames, frames[1:]))
    timeline = window.timeline
    expected = [narrate(r, 0, timeline.position_text, timeline.info.config.policy) for r in timeline.records]
    cues = path.with_suffix(".srt").read_text().split("\n\n")
    assert [cue.split("\n")[2] for cue in cues if cue] == [" ".join(e.split()) for e in expected]


def test_a_view_recording_from_a_trace_has_the_views_size_and_stops_when_cancelled(qtbot, tmp_path):
    from pagevis.gui.video_frames import find_view, record, timeline_scene
    from tests.gui_helpers import make_window, write_synthetic_trace

    trace, _ = write_synthetic_trace(tmp_path, 5)
    window = make_window(qtbot, tmp_path)
    assert window.open_trace(str(trace))
    view = find_view(window, "page-grid")
    with pytest.raises(ValueError, match="no such view; the views are page-grid, attention"):
        find_view(window, "nope")
    full = record(timeline_scene(window, target=view.export_target()), str(tmp_path / "grid.gif"), fps=4,
                  caption=False)
    frames = decode(tmp_path / "grid.gif")
    target = view.export_target()
    assert full.frames == len(frames) == 5
    assert frames[0].shape[:2] == (target.height() + target.height() % 2, target.width() + target.width() % 2)
    assert sum(np.any(a != b) for a, b in zip(frames, frames[1:])) >= 3  # the grid changes as tokens are evicted
    cut = record(timeline_scene(window), str(tmp_path / "cut.webm"), fps=4, progress=lambda done, total: done < 2)
    assert cut.cancelled and cut.frames == 2 and len(decode(tmp_path / "cut.webm")) == 2
    past = record(timeline_scene(window, first=3, frames=10), str(tmp_path / "past.gif"), fps=4)
    assert past.ended and not past.cancelled and past.frames == 2  # steps 3 and 4 of the trace's 5


def test_replay_record_from_the_command_line(tmp_path, capfd):
    from tests.gui_helpers import write_synthetic_trace

    trace, session = write_synthetic_trace(tmp_path, 4)
    out = tmp_path / "replay.mp4"
    assert main(["replay", str(trace), "--record", str(out), "--fps", "8", "--record-view", "text",
                 "--record-width", "200"]) == 0
    err = capfd.readouterr().err
    assert f"wrote {out}: 4 frames of 200 × " in err and "replay.srt" in err
    frames = decode(out)
    assert len(frames) == 4 and frames[0].shape[1] == 200


def test_file_menu_export_recording_records_the_chosen_steps_and_keeps_the_shown_one(qtbot, tmp_path):
    from pagevis.gui.widgets.recording import Choice, RecordDialog, sources
    from tests.gui_helpers import make_window

    window = make_window(qtbot, tmp_path)
    window.runner.step_blocking(5)
    window.scrub(2)
    assert "Export &recording (MP4, WebM, GIF)…" in [a.text() for a in window.menuBar().actions()[0].menu().actions()]
    dialog = RecordDialog(window)
    assert sources(window)[:3] == ["Whole window", "Page grid", "Attention"] and "Server window" not in sources(window)
    assert dialog.last.maximum() == 4 and dialog.choice().last == 4 and not dialog.frames.isEnabled()
    dialog.first.setValue(1)
    dialog.last.setValue(3)
    dialog.source.setCurrentText("Text")
    dialog.path.setText(str(tmp_path / "menu.webm"))
    result = window.files.export_recording(dialog.choice())
    assert result.frames == 3 and len(decode(tmp_path / "menu.webm")) == 3 and window.index == 2
    cues = (tmp_path / "menu.vtt").read_text()
    assert "step 1:" in cues and "step 3:" in cues and "step 4:" not in cues and "step 0:" not in cues
    grid = window.files.export_recording(Choice("Page grid", str(tmp_path / "grid.gif"), first=2, last=None, fps=5))
    target = window.page_grid.export_target()
    assert grid.frames == 3 and grid.size[0] == target.width() + target.width() % 2
    assert window.files.export_recording(Choice("Whole window", str(tmp_path / "x.avi"))) is None
    assert "unknown video format '.avi'" in window.messages.toPlainText()


@pytest.mark.slow  # decodes as it records (2-3 s on a quiet 2-core machine, more under load)
def test_server_window_recording_takes_one_engine_step_a_frame(qtbot, tmp_path):
    from pagevis.engine import ModelSpec
    from pagevis.gui.video_frames import record, server_scene
    from pagevis.gui.server.window import ServerWindow
    from pagevis.presets import SERVER_PRESETS

    model = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1).load()
    window = ServerWindow(model, SERVER_PRESETS[0], realtime=False)
    qtbot.addWidget(window)
    window.resize(1200, 800)
    window.show()
    result = record(server_scene(window, 4), str(tmp_path / "server.mp4"), fps=4, width=600)
    frames = decode(tmp_path / "server.mp4")
    assert result.frames == len(frames) == 4 and frames[0].shape[1] == 600
    assert sum(side.n_steps for side in window.sides) == 4  # one engine step a frame (A/B: the side behind)
    cues = (tmp_path / "server.srt").read_text()
    assert cues.count("-->") >= 2 and window.status.text().split(" · ")[0] in cues  # the status line, each step


def test_a_missing_encoder_names_the_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import raises ImportError
    with pytest.raises(RecordingError, match=r"needs imageio-ffmpeg, which is not installed: pip install 'pagevis\[record\]'"):
        check_target("demo.webm")
    check_target("demo.gif")  # Pillow is still there


@pytest.mark.slow  # a process of its own: in one under pytest-qt, Qt's messages go to pytest-qt's handler
def test_recording_headless_prints_no_size_hint_notices(tmp_path):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pagevis", "--model", "synthetic", "--record", str(tmp_path / "r.gif"),
                           "--steps", "3"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert done.returncode == 0, done.stderr
    assert "propagateSizeHints" not in done.stderr  # the offscreen platform said it 5-9 times a recording


def test_an_800_px_recordings_caption_wraps_to_two_lines_instead_of_cutting_the_narration(qtbot):
    from PySide6.QtGui import QFont, QFontMetrics, QImage

    from pagevis.gui.video_frames import CAPTION_PADDING, CAPTION_POINTS, caption_lines, with_caption, wrap_words

    narration = ("step 59: cache full → sinks evicted position 20 '\\n' from page 2 slot 4; wrote position 112 "
                 "' process' there · next ' allows'")
    font = QFont()
    font.setPointSize(CAPTION_POINTS)
    metrics = QFontMetrics(font)
    room = 800 - 2 * CAPTION_PADDING
    assert metrics.horizontalAdvance(narration) > room  # one line would cut it
    lines = wrap_words(narration, metrics, room, caption_lines(800))
    assert len(lines) == 2 and " ".join(lines) == narration  # whole, in two lines
    assert all(metrics.horizontalAdvance(line) <= room for line in lines)
    sizes = {with_caption(QImage(800, 100, QImage.Format_RGB888), text).size().toTuple()
             for text in ("", "short", narration)}
    assert len(sizes) == 1  # every frame of a video has one size
    assert caption_lines(1600) == 1

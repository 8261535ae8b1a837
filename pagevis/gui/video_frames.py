"""Recording a window step by step to a video (pagevis.export.video): the main window, one of its views, the
A/B window or the Server window, each frame with the step's narration burnt in below it.

A scene says what a frame is: a window that scrubs a timeline (main, A/B) shows its recorded step i, decoding
the next step first when i is past the newest and `decode` allows it; the Server window (no timeline) takes one
more engine step per frame. Frames are rendered on the GUI thread (Qt paints widgets only there) and go to the
encoder one by one: memory holds one frame, whatever the number of steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PySide6.QtCore import QPoint, QRect, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QImage, QPainter, QTextDocumentFragment
from PySide6.QtWidgets import QApplication, QWidget

from pagevis.export.video import open_video, sidecar_path
from pagevis.gui.widgets import theme

CAPTION_POINTS = 12
WIDE_CAPTION = 1200  # frames at least this wide caption in one line
CAPTION_PADDING = 8


@dataclass
class Scene:
    target: QWidget  # what each frame grabs
    frames: int  # at most this many
    advance: Callable[[int], bool]  # draw frame i; False when there is none (the session ended)
    caption: Callable[[], str]  # the shown frame's caption


@dataclass
class Recording:
    path: str
    sidecar: str | None
    frames: int
    size: tuple[int, int]
    seconds: float
    cancelled: bool = False
    ended: bool = False  # the scene had no more frames (the session ended) before the number asked for


def timeline_scene(window, first: int = 0, frames: int | None = None, target: QWidget | None = None,
                   decode: bool = False) -> Scene:
    """Steps first.. of a main or A/B window (anything with `timeline`, `scrub`, `runner`); with `decode`,
    steps past the newest are decoded as the recording reaches them (until the session ends)."""

    def advance(i: int) -> bool:
        index = first + i
        runner = window.runner
        while decode and index >= len(window.timeline) and runner.session is not None and not runner.session.done:
            count = len(window.timeline)
            runner.step_blocking(1)
            if len(window.timeline) == count:  # the step failed (reported by the window as usual)
                break
        if index >= len(window.timeline):
            return False
        window.scrub(index)
        return True

    count = frames if frames is not None else max(len(window.timeline) - first, 0)
    return Scene(target or window, count, advance, lambda: window_caption(window))


def server_scene(window, frames: int) -> Scene:
    """The Server window, one engine step per frame."""

    def advance(_i: int) -> bool:
        if window.stepper is not None and window.stepper.done:
            return False
        return window.step_blocking(1) > 0 or window.stepper is not None and not window.busy

    return Scene(window, frames, advance, lambda: window.status.text())


def window_caption(window) -> str:
    """The main window's narration line; the A/B window's one-line comparison (its rich text as plain)."""
    narration = getattr(window, "narration", None)
    if narration is not None:
        return narration.text()
    return QTextDocumentFragment.fromHtml(window.describe()).toPlainText()


def record(scene: Scene, path: str, fps: float, caption: bool = True,
           progress: Callable[[int, int], bool] | None = None, width: int | None = None) -> Recording:
    """Render the scene's frames to `path`; `progress(done, total)` after each frame (False cancels: the frames
    so far stay a playable file). With `width`, frames wider than it are scaled down to it (a GIF of the whole
    window is several times smaller at half its width); the caption is drawn after, at full sharpness."""
    app = QApplication.instance()
    started = time.perf_counter()
    # a whole window shows its own narration (its line, the A/B's headline, the Server's status): burnt in below
    # too, every frame said it twice; a single view gets the caption (and every recording its subtitles file)
    caption = caption and not scene.target.isWindow()
    writer = open_video(path, fps)
    cancelled = ended = False
    try:
        for i in range(scene.frames):
            if not scene.advance(i):
                ended = True
                break
            app.processEvents()  # let queued repaints and layout settle before the grab
            text = scene.caption()
            image = grab(scene.target)
            if width is not None and image.width() > width:
                image = image.scaledToWidth(width, Qt.SmoothTransformation)
            writer.add(rgb_array(with_caption(image, text) if caption else image), text)
            if progress is not None and progress(i + 1, scene.frames) is False:
                cancelled = True
                break
    finally:
        writer.close()
    return Recording(path, sidecar_path(path), writer.frames, writer.size or (0, 0), time.perf_counter() - started,
                     cancelled, ended)


def grab(widget: QWidget) -> QImage:
    return widget.grab().toImage()


def caption_lines(width: int) -> int:
    """Lines of the caption strip for frames this wide: one from WIDE_CAPTION px, else two (an 800-px GIF's one
    line cut the narration in half). Fixed per width, so that every frame of a video has one size."""
    return 1 if width >= WIDE_CAPTION else 2


def with_caption(image: QImage, text: str) -> QImage:
    """The image with the caption in a strip below it: caption_lines(width) lines, words wrapped, the last
    line elided only where the text needs more."""
    font = QFont()
    font.setPointSize(CAPTION_POINTS)
    metrics = QFontMetrics(font)
    width, height = image.width(), image.height()
    room, lines = width - 2 * CAPTION_PADDING, caption_lines(image.width())
    strip = lines * metrics.lineSpacing() + 2 * CAPTION_PADDING
    out = QImage(width, height + strip, QImage.Format_RGB888)
    out.fill(QColor(theme.BACKGROUND))
    painter = QPainter(out)
    try:
        painter.drawImage(QPoint(0, 0), image)
        painter.setFont(font)
        painter.setPen(QColor(theme.TEXT))
        for i, line in enumerate(wrap_words(" ".join(text.split()), metrics, room, lines)):
            painter.drawText(QRect(CAPTION_PADDING, height + CAPTION_PADDING + i * metrics.lineSpacing(), room,
                                   metrics.lineSpacing()), Qt.AlignVCenter | Qt.AlignLeft, line)
    finally:
        painter.end()
    return out


def wrap_words(text: str, metrics: QFontMetrics, room: int, lines: int) -> list[str]:
    """At most `lines` lines of `text` within `room` px, broken between words; the last elided if need be."""
    out, words = [], text.split(" ")
    while words and len(out) < lines - 1:
        line = words.pop(0)
        while words and metrics.horizontalAdvance(f"{line} {words[0]}") <= room:
            line += " " + words.pop(0)
        out.append(line)
    if words:
        out.append(metrics.elidedText(" ".join(words), Qt.ElideRight, room))
    return out


def rgb_array(image: QImage) -> np.ndarray:
    """(height, width, 3) uint8 RGB, a copy (the QImage's rows are padded to 4 bytes)."""
    image = image.convertToFormat(QImage.Format_RGB888)
    width, height, stride = image.width(), image.height(), image.bytesPerLine()
    rows = np.frombuffer(image.constBits(), np.uint8, count=stride * height).reshape(height, stride)
    return rows[:, :width * 3].reshape(height, width, 3).copy()


@dataclass
class Request:
    """A recording asked for on the command line (`pagevis --record`, `pagevis replay --record`)."""

    path: str
    fps: float = 10.0
    view: str | None = None  # a view's title (any case, '-' for ' '): only that view of the main window
    caption: bool = True
    progress: Callable[[int, int], bool] | None = None
    width: int | None = None  # scale frames down to this width


def find_view(window, name: str):
    """The main window's view titled `name` (case and '-' / ' ' ignored); ValueError naming the views."""
    key = name.lower().replace("-", " ").strip()
    for view in window.views:
        if view.title.lower() == key:
            return view
    names = ", ".join(v.title.lower().replace(" ", "-") for v in window.views)
    raise ValueError(f"--record-view {name!r}: no such view; the views are {names}")


def record_from_launch(app, window, request: Request, steps: int, trace: str | None, ab) -> int:
    """The command line's recording: `steps` decoded steps of the window's session (or of the A/B window with
    `ab`), or every step of `trace`; one line on stderr says what was written. Exit code 0, 1 or 2."""
    import sys

    from pagevis.gui import open_for_picture

    view = None
    try:
        if request.view is not None:
            if ab is not None:
                raise ValueError("--record-view records a view of the main window; an A/B preset records the "
                                 "A/B window")
            view = find_view(window, request.view)
    except ValueError as error:
        print(f"pagevis: error: {error}", file=sys.stderr)
        window.close()
        return 2
    shown = open_for_picture(app, window, ab, "the recording", trace)
    if shown is None:
        return 1
    target = view.export_target() if view is not None else shown
    scene = timeline_scene(shown, frames=None if trace else steps, target=target, decode=trace is None)
    return _record_request(scene, request, {shown, window})


def record_window(window, request: Request, steps: int) -> int:
    """The command line's recording of the Server window: `steps` engine steps, one frame each."""
    return _record_request(server_scene(window, steps), request, {window})


def _record_request(scene: Scene, request: Request, windows) -> int:
    """Record, close the windows, say in one line on stderr what was written (or why not): exit code 0 or 2."""
    import sys

    from pagevis.export.video import RecordingError

    try:
        result = record(scene, request.path, request.fps, request.caption, request.progress, request.width)
    except (RecordingError, OSError) as error:
        print(f"pagevis: error: {error}", file=sys.stderr)
        return 2
    finally:
        for window in windows:
            window.close()
    print(f"pagevis: wrote {result.path}: {result.frames} frames of {result.size[0]} × {result.size[1]} at "
          f"{request.fps:g} fps ({result.frames / request.fps:.1f} s of video) in {result.seconds:.1f} s"
          + (f"; captions in {result.sidecar}" if result.sidecar else "")
          + (f"; the session ended after {result.frames} of the {scene.frames} steps asked for" if result.ended else ""),
          file=sys.stderr)
    return 0

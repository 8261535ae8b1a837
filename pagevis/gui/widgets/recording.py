"""File ▸ Export recording…: what to record (the main window, one view, the A/B or the Server window), which
steps, the frame rate and the file; then the frames, with a progress dialog that can cancel."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QProgressDialog,
    QPushButton,
    QWidget,
)

from pagevis.export.video import FORMATS, MAX_FPS, MAX_SIDE, MIN_FPS, RecordingError
from pagevis.gui.video_frames import Recording, record, server_scene, timeline_scene
from pagevis.gui.widgets.setting_inputs import combo, spin

WHOLE_WINDOW, AB_WINDOW, SERVER_WINDOW = "Whole window", "A/B window", "Server window"
SERVER_FRAMES = 200  # the Server window's default: engine steps to record (it has no timeline to scrub)
FILTER = ";;".join(f"{label} (*{suffix})" for suffix, label in FORMATS.items())


@dataclass
class Choice:
    source: str  # WHOLE_WINDOW, a view's title, AB_WINDOW or SERVER_WINDOW
    path: str
    first: int = 0  # timeline windows: the steps first..last
    last: int | None = None
    frames: int = SERVER_FRAMES  # the Server window: engine steps
    fps: float = 10.0
    caption: bool = True
    width: int = 0  # 0: frames at the window's size; else scaled down to this width


def sources(main) -> list[str]:
    """What the main window can record now: itself, each view, and the A/B and Server windows if open."""
    names = [WHOLE_WINDOW, *(v.title for v in main.views)]
    if main.ab_window is not None and main.ab_window.isVisible():
        names.append(AB_WINDOW)
    server = main.files.server_window
    if server is not None and server.isVisible():
        names.append(SERVER_WINDOW)
    return names


class RecordDialog(QDialog):
    def __init__(self, main, parent: QWidget | None = None):
        super().__init__(parent or main)
        self.setWindowTitle("Export recording")
        self.main = main
        steps = len(main.timeline) if main.timeline is not None else 0
        self.source = combo()
        self.source.addItems(sources(main))
        self.first = spin(0, max(steps - 1, 0), 0, "the first recorded step to show")
        self.last = spin(0, max(steps - 1, 0), max(steps - 1, 0), "the last recorded step to show")
        self.frames = spin(1, 100_000, SERVER_FRAMES, "Server window: engine steps to take, one frame each")
        self.fps = spin(MIN_FPS, MAX_FPS, 10, "frames (steps) a second in the video")
        self.width = spin(0, MAX_SIDE, 0, "scale frames down to this width in pixels (0: the window's size; a GIF "
                          "of the whole window is several times smaller at 800)", step=100)
        self.width.setSpecialValueText("window size")
        self.caption = QCheckBox("Narration burnt in below each frame", checked=True)
        self.path = QLineEdit("pagevis-session.mp4")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        where = QHBoxLayout()
        where.addWidget(self.path, 1)
        where.addWidget(browse)
        form = QFormLayout(self)
        form.addRow("Record", self.source)
        form.addRow("From step", self.first)
        form.addRow("To step", self.last)
        form.addRow("Server steps", self.frames)
        form.addRow("Frames a second", self.fps)
        form.addRow("Width", self.width)
        form.addRow("", self.caption)
        form.addRow("File (.mp4, .webm, .gif)", where)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.button(QDialogButtonBox.Ok).setText("Record")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.source.currentTextChanged.connect(self._source_changed)
        self._source_changed(self.source.currentText())

    def _source_changed(self, name: str) -> None:
        server = name == SERVER_WINDOW
        self.first.setEnabled(not server)
        self.last.setEnabled(not server)
        self.frames.setEnabled(server)

    def _browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export recording", self.path.text(), FILTER)
        if path:
            self.path.setText(path)

    def choice(self) -> Choice:
        return Choice(self.source.currentText(), self.path.text().strip(), self.first.value(), self.last.value(),
                      self.frames.value(), float(self.fps.value()), self.caption.isChecked(), self.width.value())


def export_recording(main, choice: Choice | None = None) -> Recording | None:
    """Ask (unless `choice` is given), then record with a progress dialog; the result is said in the status
    bar, a problem in the Messages panel. Decoding pauses first: the frames are the steps recorded so far."""
    if choice is None:
        dialog = RecordDialog(main)
        if dialog.exec() != QDialog.Accepted:
            return None
        choice = dialog.choice()
    if choice.source != SERVER_WINDOW and (main.timeline is None or not len(main.timeline)):
        main.statusBar().showMessage("Nothing to record yet: decode a step first", 5000)
        return None
    main.runner.stop()
    window = _window(main, choice.source)
    if choice.source == SERVER_WINDOW:
        window.shutdown()  # the frames are its next steps, taken on this thread: its worker must be done
    elif window is not main:
        window.runner.stop()
    shown = getattr(window, "index", -1)  # a timeline window shows this step again afterwards
    scene = _scene(main, window, choice)
    progress = QProgressDialog(f"Recording {choice.path}…", "Stop", 0, scene.frames, main)
    progress.setWindowTitle("Export recording")
    progress.setWindowModality(Qt.WindowModal)
    progress.setMinimumDuration(500)

    def advanced(done: int, total: int) -> bool:
        progress.setValue(done)
        return not progress.wasCanceled()

    try:
        result = record(scene, choice.path, choice.fps, choice.caption, advanced, choice.width or None)
    except (RecordingError, OSError) as error:
        main.report(f"Could not record {choice.path}: {error}")
        return None
    finally:
        progress.close()
        if shown >= 0:
            window.scrub(shown)
    sidecar = f" and captions in {result.sidecar}" if result.sidecar else ""
    stopped = " (stopped)" if result.cancelled else " (the session ended there)" if result.ended else ""
    main.statusBar().showMessage(f"Recorded {result.frames} frames to {result.path}{sidecar}{stopped}", 8000)
    return result


def _window(main, source: str):
    return {AB_WINDOW: main.ab_window, SERVER_WINDOW: main.files.server_window}.get(source, main)


def _scene(main, window, choice: Choice):
    if choice.source == SERVER_WINDOW:
        return server_scene(window, choice.frames)
    last = len(window.timeline) - 1 if choice.last is None else min(choice.last, len(window.timeline) - 1)
    first = min(choice.first, last)
    views = {v.title: v for v in main.views}
    target = views[choice.source].export_target() if choice.source in views else window
    return timeline_scene(window, first=first, frames=last - first + 1, target=target)

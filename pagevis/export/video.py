"""Frames to a video file: MP4 (H.264) and WebM (VP9) through the ffmpeg binary that imageio-ffmpeg ships, GIF
through Pillow. Each frame's caption also goes to a sidecar subtitle file beside an MP4 (SubRip, .srt: what
desktop players load by name) or a WebM (WebVTT, .vtt: what a browser's <track> reads).

Memory is bounded whatever the number of frames: every frame goes to the encoder (a pipe to ffmpeg, or the
GIF file) as it is added, and a writer keeps at most the previous frame (the GIF writer, to write only the
rectangle that changed) and the current caption. Only Qt-free arrays: (height, width, 3) uint8 RGB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FORMATS = {".mp4": "MP4 (H.264)", ".webm": "WebM (VP9)", ".gif": "GIF"}
SIDECARS = {".mp4": ".srt", ".webm": ".vtt"}
INSTALL = "pip install 'pagevis[record]'"
MIN_FPS, MAX_FPS = 1, 60
MIN_WIDTH = 160  # pixels: narrower, no caption or grid is readable
MAX_SIDE = 8192  # pixels: no window or view here is larger, and an encoder's frame must fit in memory twice
H264 = ["-preset", "veryfast", "-crf", "23", "-movflags", "+faststart"]
TRANSPARENT = 255  # a GIF frame's palette index for "as in the previous frame"
VP9 = ["-deadline", "realtime", "-cpu-used", "8", "-row-mt", "1", "-crf", "34", "-b:v", "0"]


class RecordingError(ValueError):
    """A recording that cannot be made: said in one line (which file or value, what is allowed)."""


def check_target(path: str) -> str:
    """The format's suffix of an output path, once its extension is known and its encoder installed."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise RecordingError(f"{path}: unknown video format {suffix or '(no extension)'!r}; give a name ending in "
                             + ", ".join(FORMATS))
    _encoder_module(suffix)
    return suffix


def check_fps(fps: float) -> None:
    if not MIN_FPS <= fps <= MAX_FPS:
        raise RecordingError(f"frame rate {fps:g}: must be from {MIN_FPS} to {MAX_FPS} frames a second")


def sidecar_path(path: str) -> str | None:
    """Where the captions of a recording at `path` go (None for a GIF, which has no subtitle track)."""
    suffix = SIDECARS.get(Path(path).suffix.lower())
    return str(Path(path).with_suffix(suffix)) if suffix else None


def _encoder_module(suffix: str):
    name = "PIL" if suffix == ".gif" else "imageio_ffmpeg"
    try:
        return __import__(name)
    except ImportError:
        package = "Pillow" if suffix == ".gif" else "imageio-ffmpeg"
        raise RecordingError(f"recording {FORMATS[suffix]} needs {package}, which is not installed: "
                             f"{INSTALL}") from None


def open_video(path: str, fps: float):
    """A writer for `path` (its format from the extension): `add(frame, caption)` each frame, then `close()`."""
    suffix = check_target(path)
    check_fps(fps)
    return GifWriter(path, fps) if suffix == ".gif" else FfmpegWriter(path, fps, suffix)


class _Writer:
    """The frame size (the first frame's, even for yuv420p) and the caption track shared by the formats."""

    def __init__(self, path: str, fps: float):
        self.path, self.fps = path, fps
        self.frames = 0
        self.size: tuple[int, int] | None = None  # (width, height)
        sidecar = sidecar_path(path)
        self.captions = CaptionTrack(sidecar, fps) if sidecar else None

    def add(self, frame: np.ndarray, caption: str = "") -> None:
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"a frame is (height, width, 3) uint8 RGB, not {frame.dtype} {frame.shape}")
        if self.size is None:
            height, width = frame.shape[:2]
            if max(height, width) > MAX_SIDE:
                raise RecordingError(f"{self.path}: frames of {width} × {height} pixels; at most {MAX_SIDE} a side")
            self.size = (width + width % 2, height + height % 2)
            self._open()
        self._write(fit(frame, self.size))
        if self.captions is not None:
            self.captions.add(self.frames, caption)
        self.frames += 1

    def close(self) -> None:
        if self.captions is not None:
            self.captions.close(self.frames)
        if self.size is not None:
            self._finish()

    def _open(self) -> None:
        raise NotImplementedError

    def _write(self, frame: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class FfmpegWriter(_Writer):
    def __init__(self, path: str, fps: float, suffix: str):
        super().__init__(path, fps)
        self.codec, self.params = ("libx264", H264) if suffix == ".mp4" else ("libvpx-vp9", VP9)
        self._pipe = None

    def _open(self) -> None:
        import imageio_ffmpeg

        self._pipe = imageio_ffmpeg.write_frames(self.path, self.size, fps=self.fps, codec=self.codec, quality=None,
                                                 macro_block_size=2, output_params=self.params,
                                                 ffmpeg_log_level="error")
        self._pipe.send(None)  # starts ffmpeg

    def _write(self, frame: np.ndarray) -> None:
        self._pipe.send(frame)

    def _finish(self) -> None:
        self._pipe.close()


class GifWriter(_Writer):
    """An animated GIF written frame by frame: each frame is the rectangle that changed since the previous one,
    with its own palette (a window's colours change as pages fill) of up to 255 colours and one transparent
    index for the pixels in that rectangle that did not change — long runs of one index, which LZW stores in
    almost nothing — drawn over the previous frame."""

    def __init__(self, path: str, fps: float):
        super().__init__(path, fps)
        self.delay_ms = max(20, round(1000 / fps / 10) * 10)  # GIF delays are hundredths; browsers treat < 2 as 10
        self._file = None
        self._previous: np.ndarray | None = None

    def _open(self) -> None:
        from PIL import GifImagePlugin, Image

        self._file = open(self.path, "wb")
        canvas = Image.new("RGB", self.size).quantize(2)
        header, _ = GifImagePlugin.getheader(canvas, info={"loop": 0, "duration": self.delay_ms})
        self._file.write(b"".join(header))

    def _write(self, frame: np.ndarray) -> None:
        from PIL import GifImagePlugin, Image

        previous, self._previous = self._previous, frame
        box = changed_box(previous, frame) or (0, 0, 1, 1)  # nothing changed: a 1-pixel frame keeps the timing
        x0, y0, x1, y1 = box
        region = np.ascontiguousarray(frame[y0:y1, x0:x1])
        indexed = Image.fromarray(region).quantize(TRANSPARENT, method=Image.Quantize.MEDIANCUT,
                                                   dither=Image.Dither.NONE)
        params = {"duration": self.delay_ms, "disposal": 1, "include_color_table": True}
        if previous is not None:
            codes = np.asarray(indexed).copy()
            codes[np.all(previous[y0:y1, x0:x1] == region, axis=2)] = TRANSPARENT
            palette = indexed.getpalette()[:3 * TRANSPARENT]
            indexed = Image.fromarray(codes, mode="P")
            indexed.putpalette(palette + [0] * (3 * 256 - len(palette)))
            params["transparency"] = TRANSPARENT
        for chunk in GifImagePlugin.getdata(indexed, offset=(x0, y0), **params):
            self._file.write(chunk)

    def _finish(self) -> None:
        self._file.write(b";")
        self._file.close()


def changed_box(previous: np.ndarray | None, frame: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x0, y0, x1, y1) around the pixels that differ from `previous` (all of them without one); None if none."""
    if previous is None or previous.shape != frame.shape:
        return 0, 0, frame.shape[1], frame.shape[0]
    differs = np.any(previous != frame, axis=2)
    rows, columns = np.flatnonzero(differs.any(axis=1)), np.flatnonzero(differs.any(axis=0))
    if not len(rows):
        return None
    return int(columns[0]), int(rows[0]), int(columns[-1]) + 1, int(rows[-1]) + 1


def fit(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The frame at exactly `size` (width, height): cropped, or padded with its edge colour (even sizes)."""
    width, height = size
    frame = frame[:height, :width]
    pad_y, pad_x = height - frame.shape[0], width - frame.shape[1]
    if pad_y or pad_x:
        frame = np.pad(frame, ((0, pad_y), (0, pad_x), (0, 0)), mode="edge")
    return np.ascontiguousarray(frame)


class CaptionTrack:
    """Subtitles written as they come: one cue per run of frames with the same caption (an empty one is no cue),
    timed by the frame rate; a cue is written when the caption changes, so only the current one is held."""

    def __init__(self, path: str, fps: float):
        self.path, self.fps = path, fps
        self.vtt = path.lower().endswith(".vtt")
        self._file = open(path, "w", encoding="utf-8", newline="\n")
        if self.vtt:
            self._file.write("WEBVTT\n\n")
        self.cues = 0
        self._text, self._start = "", 0

    def add(self, frame: int, caption: str) -> None:
        caption = " ".join(caption.split())
        if caption != self._text:
            self._flush(frame)
            self._text, self._start = caption, frame

    def close(self, frames: int) -> None:
        self._flush(frames)
        self._file.close()

    def _flush(self, end: int) -> None:
        if not self._text or end <= self._start:
            return
        self.cues += 1
        start, stop = self._clock(self._start), self._clock(end)
        number = "" if self.vtt else f"{self.cues}\n"
        self._file.write(f"{number}{start} --> {stop}\n{self._text}\n\n")

    def _clock(self, frame: int) -> str:
        ms = round(frame * 1000 / self.fps)
        h, rest = divmod(ms, 3_600_000)
        m, rest = divmod(rest, 60_000)
        s, ms = divmod(rest, 1000)
        return f"{h:02d}:{m:02d}:{s:02d}{'.' if self.vtt else ','}{ms:03d}"

"""`--record FILE` for the app and `pagevis replay`: the window, step by step, to MP4 / WebM / GIF."""

from __future__ import annotations

import argparse

from pagevis.cli.options import UsageError, check_range, check_writable
from pagevis.cli.progress import Progress
from pagevis.export.video import FORMATS, INSTALL, MAX_FPS, MAX_SIDE, MIN_FPS, MIN_WIDTH, RecordingError, check_target


def add_record_options(group) -> None:
    group.add_argument("--record", metavar="FILE",
                       help="record the window step by step to a video (" + ", ".join(FORMATS) + ", from the "
                            "extension; headless), the narration as a caption (and an .srt / .vtt beside an MP4 / "
                            f"WebM), then quit; needs {INSTALL}")
    group.add_argument("--fps", type=float, default=10.0, metavar="N",
                       help=f"with --record: frames (steps) a second, {MIN_FPS} to {MAX_FPS} (default 10)")
    group.add_argument("--record-view", metavar="VIEW",
                       help="with --record: only this view of the main window (page-grid, attention, text, "
                            "eviction-events, metrics, heads, weights)")
    group.add_argument("--record-width", type=int, metavar="PIXELS",
                       help=f"with --record: scale frames down to this width ({MIN_WIDTH} to {MAX_SIDE}; a GIF of "
                            "the whole window is several times smaller at 800)")
    group.add_argument("--no-caption", action="store_true",
                       help="with --record: no caption burnt into the frames (an MP4 / WebM still gets the sidecar)")


def recording_request(args: argparse.Namespace, total: int):
    """The recording the flags ask for (checked: format, encoder installed, writable path, frame rate), or None."""
    if args.record is None:
        if args.record_view is not None or args.no_caption or args.record_width is not None:
            raise UsageError("--record-view, --record-width and --no-caption go with --record FILE")
        return None
    try:
        check_target(args.record)
    except RecordingError as error:
        raise UsageError(str(error)) from None
    check_range("--fps", args.fps, MIN_FPS, MAX_FPS)
    check_writable(args.record, "--record")
    if args.record_width is not None:
        check_range("--record-width", args.record_width, MIN_WIDTH, MAX_SIDE)
    from pagevis.gui.video_frames import Request

    bar = Progress(total, "recording")

    def progress(done: int, _total: int) -> bool:
        bar.update(done)
        if done >= total:
            bar.close()
        return True

    return Request(args.record, fps=args.fps, view=args.record_view, caption=not args.no_caption, progress=progress,
                   width=args.record_width)

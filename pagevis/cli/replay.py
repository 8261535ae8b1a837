"""`pagevis replay FILE`: open a trace in the app."""

from __future__ import annotations

import argparse

from pagevis.cli.options import UsageError, check_range, check_writable
from pagevis.cli.record_options import add_record_options, recording_request


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("replay", help="open a trace file in the app",
                                 description="Open a trace recorded with `pagevis run --trace` in the app, "
                                             "to scrub its timeline and views as they were live.")
    parser.add_argument("file", metavar="FILE", help="the trace file")
    parser.add_argument("--check", action="store_true",
                        help="only read and validate the trace, build the timeline a replay shows, print a summary "
                             "and exit (no window): exit 0 means the app can replay it")
    add_record_options(parser.add_argument_group("recording"))
    page = parser.add_argument_group("HTML page")
    page.add_argument("--html", metavar="FILE",
                      help="write the trace as one self-contained HTML page (page grid, text, eviction events, "
                           "scrubbable by step; opens in any browser without pagevis) and exit")
    page.add_argument("--layer", type=int, default=0, metavar="N", help="with --html: the layer shown (default 0)")
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from pagevis.trace import read_trace

    if args.html is not None:
        check_writable(args.html, "--html", suffix=".html")  # before the trace is read: fail fast
    trace = read_trace(args.file)  # refuse a bad file here, with a clear message, before Qt starts
    if args.html is not None:
        return write_page(args, trace)
    recording = recording_request(args, len(trace.records))
    if args.check:
        from pagevis.viewmodel.timeline import timeline_from_trace  # Qt-free: what the app's replay builds

        timeline_from_trace(trace)
        config = trace.config
        print(f"{args.file}: {trace.model_label}, {len(trace.prompt_ids)} prompt tokens, {len(trace.records)} steps, "
              f"{config.max_pages} pages x {config.page_size} tokens, policy {config.policy}, "
              f"stopped: {trace.stop_reason}")
        return 0
    from pagevis.gui import launch

    return launch(trace=args.file, recording=recording)


def write_page(args: argparse.Namespace, trace) -> int:
    from pagevis.export.html import HtmlExportError, write_html
    from pagevis.viewmodel.timeline import timeline_from_trace

    timeline = timeline_from_trace(trace)
    check_range("--layer", args.layer, 0, timeline.info.n_layers - 1)
    try:
        size = write_html(args.html, timeline, args.layer)
    except HtmlExportError as error:
        raise UsageError(str(error)) from None
    print(f"pagevis: wrote {args.html}: {len(trace.records)} steps of layer {args.layer}, {size / 1024:.0f} KiB "
          f"({size / len(trace.records):.0f} bytes a step)")
    return 0

"""`pagevis replay FILE`: open a trace in the app."""

from __future__ import annotations

import argparse

from pagevis.cli.record import add_record_options, recording_request


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("replay", help="open a trace file in the app",
                                 description="Open a trace recorded with `pagevis run --trace` in the app, "
                                             "to scrub its timeline and views as they were live.")
    parser.add_argument("file", metavar="FILE", help="the trace file")
    parser.add_argument("--check", action="store_true",
                        help="only read and validate the trace, build the timeline a replay shows, print a summary "
                             "and exit (no window): exit 0 means the app can replay it")
    add_record_options(parser.add_argument_group("recording"))
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from pagevis.trace import read_trace

    trace = read_trace(args.file)  # refuse a bad file here, with a clear message, before Qt starts
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

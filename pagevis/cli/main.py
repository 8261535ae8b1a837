"""The `pagevis` entry point: no command opens the app; `run`, `compare`, `bench`, `replay` work headless.

Bad arguments and unusable inputs (files, models, traces, configurations) exit with status 2 and one line
on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import options
from .metrics_port import add_metrics_option, start_metrics_server
from .options import ArgumentParser, UsageError

COMMANDS = ("run", "compare", "bench", "replay", "serve")

USAGE = """pagevis [options]            open the app (options below preset it)
       pagevis run [options]        decode headless, print the text or --json
       pagevis compare [TEXTFILE]   perplexity and oracle metrics per policy and cache budget
       pagevis bench [--quick]      paged vs dense attention, storage, decode speed
       pagevis replay FILE          open a trace file in the app
       pagevis serve [options]      HTTP API: attention, sessions, OpenAI-compatible completions, /metrics
       pagevis COMMAND --help       the options of a command"""


def gui_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="pagevis", usage=USAGE,
                            description="Watch a language model decode with its KV cache in fixed-size pages.")
    options.add_session_options(parser)
    group = parser.add_argument_group("app")
    group.add_argument("--screenshot", metavar="FILE", help="save a PNG of the window after --steps steps, then quit")
    group.add_argument("--steps", type=int, default=0, metavar="N", help="decode N steps at start (with --screenshot)")
    add_metrics_option(group)
    return parser


def command_parser() -> ArgumentParser:
    from . import bench, compare, replay, run, serve

    parser = ArgumentParser(prog="pagevis", usage=USAGE)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser, prog="pagevis")
    for module in (run, compare, bench, replay, serve):
        module.add_parser(commands).add_argument(
            "--blas-threads", type=int, default=1, metavar="N",
            help="threads NumPy's BLAS may use (default 1: decoding is memory-bound, and spinning BLAS threads "
                 "slow it down several times when another process is busy)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            args = command_parser().parse_args(argv)
            use_blas_threads(args.blas_threads)
            return args.handler(args)
        if argv and not argv[0].startswith("-"):
            raise UsageError(f"pagevis: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} "
                             "(see pagevis --help)")
        return launch_app(gui_parser().parse_args(argv))
    except SystemExit as done:  # --help and --version end here
        return done.code if isinstance(done.code, int) else 0
    except BaseException as error:  # noqa: BLE001 - sorted below: known errors become one line, status 2
        message = user_error_message(error)
        if message is None:
            raise
        print(f"pagevis: error: {message}" if not message.startswith("pagevis") else message, file=sys.stderr)
        return 2


def use_blas_threads(count: int) -> None:
    """Decoding is memory-bound: one BLAS thread is ~as fast on an idle machine and several times faster
    when another process holds a core (spin-waiting OpenBLAS threads); see pagevis.model.blas_threads."""
    if count < 1:
        raise UsageError(f"pagevis: --blas-threads {count}: must be at least 1")
    from ..model import set_blas_threads

    set_blas_threads(count)


def user_error_message(error: BaseException) -> str | None:
    """One line for an error the user can fix (arguments, files, models, configurations); None for a bug."""
    from ..engine import ConfigError
    from ..model.errors import ModelConfigError, ModelLoadError
    from ..trace import TraceError

    if isinstance(error, UsageError):
        return str(error)
    if isinstance(error, ConfigError):
        return options.describe_config_error(error)
    if isinstance(error, (ModelLoadError, ModelConfigError, TraceError)):
        return str(error)
    if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
        return f"{error.filename}: {error.strerror}"
    return None


def launch_app(args: argparse.Namespace) -> int:
    spec = options.model_spec(args) if args.model or any(
        getattr(args, flag) is not None for flag in options.SYNTHETIC_FLAGS) else None
    prompt = options.prompt_text(args)
    config = options.session_config(args) if options.session_options_given(args) else None
    if args.steps < 0:
        raise UsageError("pagevis: --steps must be 0 or more")
    metrics, _exporter = start_metrics_server(args.metrics_port)  # a daemon thread, until the app quits
    from ..gui import launch

    return launch(model_spec=spec, prompt=prompt, session_config=config, screenshot=args.screenshot,
                  steps=args.steps, metrics=metrics)

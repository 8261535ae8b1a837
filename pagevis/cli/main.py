"""The `pagevis` entry point: no command opens the app; `run`, `compare`, `bench`, `replay` work headless.

Bad arguments and unusable inputs (files, models, traces, configurations) exit with status 2 and one line
on stderr, never a traceback. Anything else is a bug: one line, "re-run with --debug for the traceback",
and status 70 (EX_SOFTWARE); with --debug the traceback is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from pagevis.cli import options
from pagevis.cli.metrics_port import add_metrics_option, start_metrics_server
from pagevis.cli.record_options import add_record_options, recording_request
from pagevis.presets import SERVER_PRESETS
from pagevis.cli.options import ArgumentParser, UsageError

COMMANDS = ("run", "compare", "eval", "bench", "replay", "serve", "attach")
USER_ERROR = 2
INTERNAL_ERROR = 70  # sysexits.h EX_SOFTWARE: a bug, not a bad input
OWN_PREFIX = re.compile(r"^pagevis(?: [a-z][a-z-]*)*: ")
MAX_STEPS = 100_000

USAGE = """pagevis [options]            open the app (options below preset it)
       pagevis run [options]        decode headless, print the text or --json
       pagevis compare [TEXTFILE]   perplexity and oracle metrics per policy and cache budget
       pagevis eval [--tasks LIST]  lm-eval tasks through the cache, per policy, budget and dtype
       pagevis bench [--quick]      paged vs dense attention, storage, decode speed
       pagevis replay FILE          open a trace file in the app
       pagevis serve [options]      HTTP API: attention, sessions, OpenAI-compatible completions, /metrics
       pagevis attach ENDPOINT ...  a vLLM / SGLang engine's KV cache from its ZMQ KV events
       pagevis COMMAND --help       the options of a command"""


def gui_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="pagevis", usage=USAGE,
                            description="Watch a language model decode with its KV cache in fixed-size pages.")
    options.add_session_options(parser)
    group = parser.add_argument_group("app")
    group.add_argument("--screenshot", metavar="FILE", help="save a PNG of the window after --steps steps, then quit")
    group.add_argument("--steps", type=int, default=0, metavar="N",
                       help="decode N steps at start (with --screenshot or --record)")
    add_record_options(group)
    group.add_argument("--server-demo", nargs="?", const="", metavar="PRESET",
                       help="open the Server window: the model serving arriving requests (a server preset: "
                            + "; ".join(p.name for p in SERVER_PRESETS) + ")")
    group.add_argument("--server-events", metavar="ENDPOINT[,REPLAY]",
                       help="with --server-demo: attach the Server window to a running `pagevis serve` "
                            "--kv-events-endpoint (and its replay endpoint): its prefix cache from the events")
    group.add_argument("--server-metrics", metavar="URL",
                       help="with --server-demo: that server's /metrics (e.g. http://127.0.0.1:8000/metrics) for "
                            "the plots")
    group.add_argument("--present", action=argparse.BooleanOptionalAction, default=None,
                       help="open in the presentation layout (View > Presentation, F5): the page grid fills the "
                            "window, the other views a tab away; --no-present: the normal layout (default: "
                            "presentation on a display at most 1366 px wide)")
    group.add_argument("--teacher-forced", metavar="FILE",
                       help="open the A/B window in its 'same text' mode on FILE (a UTF-8 text, or a shipped "
                            "text's name such as pride-and-prejudice-ch1): both sides read it one token a step beside "
                            "the full cache, their perplexities live; the sides are an A/B --preset's, else the "
                            "options' cache against the same cache with the other of sinks / oldest")
    group.add_argument("--tour", action="store_true",
                       help="start the guided tour (Help > Tour): the StreamingLLM A/B, then Sequences, then the "
                            "Server window, each with one line on what to look at")
    add_metrics_option(group)
    add_weight_options(parser, threads_default=APP_WEIGHT_THREADS)
    add_debug_option(parser)
    return parser


# The app decodes on one core and leaves the other to its window (docs/model.md: its step rate either way).
APP_WEIGHT_THREADS = 1


def add_weight_options(parser: argparse.ArgumentParser, threads_default: int | None) -> None:
    parser.add_argument("--weights", choices=("quantized", "float32"), default="quantized",
                        help="quantized (default): a GGUF's matrices stay as the file stores them (Q4_1, Q8_0, "
                             "Q4_K, ...), multiplied block by block; float32: dequantised at load, BLAS products")
    parser.add_argument("--threads", type=int, default=threads_default, metavar="N",
                        help="threads for the products with quantized weights (1 or 2; default: "
                             + ("every core, up to 2" if threads_default is None else str(threads_default)) + ")")


def use_weight_options(args: argparse.Namespace) -> None:
    from pagevis.model.quant_weights import set_weight_format
    from pagevis.model.weight_threads import set_weight_threads

    if args.threads is not None:
        options.check_range("--threads", args.threads, 1, 2)
    set_weight_format(args.weights)
    set_weight_threads(args.threads)


def add_debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an unexpected error, print the full traceback (it is one line otherwise)")


def command_parser() -> ArgumentParser:
    from pagevis.cli import attach, bench, compare, eval, replay, run, serve

    parser = ArgumentParser(prog="pagevis", usage=USAGE)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser, prog="pagevis")
    for module in (run, compare, eval, bench, replay, serve, attach):
        command = module.add_parser(commands)
        for each in (command, *getattr(command, "subcommands", ())):  # `bench weights`, `bench engine`, ...
            each.add_argument(
                "--blas-threads", type=int, default=1, metavar="N",
                help="threads NumPy's BLAS may use with --weights float32 (default 1: decoding is memory-bound, and "
                     "spinning BLAS threads slow it down several times when another process is busy; quantized "
                     "weights use --threads and one BLAS thread per thread)")
            add_weight_options(each, threads_default=None)
            add_debug_option(each)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed: list[argparse.Namespace] = []  # the arguments, once parsed: errors name only flags they hold
    try:
        if argv and argv[0] in COMMANDS:
            args, unknown = command_parser().parse_known_args(argv)
            if unknown:  # found by the top parser, which would point at its own --help
                raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see pagevis {argv[0]} --help)")
            parsed.append(args)
            use_blas_threads(parsed[0].blas_threads)
            use_weight_options(parsed[0])
            return parsed[0].handler(parsed[0])
        if argv and not argv[0].startswith("-"):
            raise UsageError(f"unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} "
                             "(see pagevis --help)")
        parsed.append(gui_parser().parse_args(argv))
        use_weight_options(parsed[0])
        return launch_app(parsed[0])
    except SystemExit as done:  # --help and --version end here
        return done.code if isinstance(done.code, int) else 0
    except KeyboardInterrupt:
        print("pagevis: interrupted", file=sys.stderr)
        return 130
    except BaseException as error:  # noqa: BLE001 - known errors become one line (2), the rest one line (70)
        message = user_error_message(error, parsed[0] if parsed else None)
        if message is not None:
            print(error_line(argv, message), file=sys.stderr)
            return USER_ERROR
        if "--debug" in argv:
            traceback.print_exc()
        summary = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"pagevis: internal error: {summary[:300]} (a bug in pagevis; re-run with --debug for the traceback)",
              file=sys.stderr)
        return INTERNAL_ERROR


def error_line(argv: list[str], message: str) -> str:
    """The one form of every user error: `pagevis COMMAND: error: MESSAGE` (`pagevis: error:` for the app),
    whether argparse or a later check found it (a message's own "pagevis ...:" prefix is dropped)."""
    prog = f"pagevis {argv[0]}" if argv and argv[0] in COMMANDS else "pagevis"
    return f"{prog}: error: {OWN_PREFIX.sub('', message, count=1)}"


def use_blas_threads(count: int) -> None:
    """Decoding is memory-bound: one BLAS thread is ~as fast on an idle machine and several times faster
    when another process holds a core (spin-waiting OpenBLAS threads); see pagevis.model.blas_threads."""
    options.check_range("--blas-threads", count, 1, max(8, os.cpu_count() or 1))
    from pagevis.model import set_blas_threads

    set_blas_threads(count)


def user_error_message(error: BaseException, args: argparse.Namespace | None = None) -> str | None:
    """One line for an error the user can fix (arguments, files, models, configurations, memory); None for a bug."""
    from pagevis.kernel_loader import KernelLoadError
    from pagevis.kvcache import ConfigError
    from pagevis.model.errors import ModelConfigError, ModelLoadError
    from pagevis.trace import TraceError

    if isinstance(error, UsageError):
        return str(error)
    if isinstance(error, ConfigError):
        return options.describe_config_error(error, args)
    if isinstance(error, (ModelLoadError, ModelConfigError, TraceError, KernelLoadError)):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    if isinstance(error, MemoryError):
        return (f"out of memory ({error or 'an allocation failed'}); choose a smaller model, cache or number "
                "of steps")
    return None


def launch_app(args: argparse.Namespace) -> int:
    spec = options.model_spec(args) if options.model_name(args) or any(
        getattr(args, flag) is not None for flag in options.SYNTHETIC_FLAGS) else None
    prompt = options.prompt_text(args)
    config = options.session_config(args) if options.session_options_given(args) else None
    options.check_range("--steps", args.steps, 0, MAX_STEPS)
    if args.screenshot:
        options.check_writable(args.screenshot, "--screenshot", suffix=".png")
    recording = recording_request(args, args.steps)
    if recording is not None and args.screenshot:
        raise UsageError("--record and --screenshot: give one of them")
    if recording is not None and args.steps < 1:
        raise UsageError("--record: give the number of steps to record with --steps N (1 or more)")
    if args.server_demo is not None or args.server_events or args.server_metrics:
        return launch_server_demo(args, spec, recording)
    preset = options.preset(args)
    if args.teacher_forced:
        preset = same_text_preset(args.teacher_forced, preset, config)
    metrics, _exporter = start_metrics_server(args.metrics_port)  # a daemon thread, until the app quits
    from pagevis.gui import launch

    return launch(model_spec=spec, prompt=prompt, session_config=config, screenshot=args.screenshot,
                  steps=args.steps, metrics=metrics, preset=preset, recording=recording,
                  **({"tour": True} if args.tour else {}), **({} if args.present is None else {"present": args.present}))


def same_text_preset(path: str, preset, config):
    """The A/B that `--teacher-forced FILE` opens: an A/B preset's sides (else the options' cache against the
    same cache with the other of sinks / oldest) reading FILE, which must be readable."""
    from dataclasses import replace

    from pagevis.cli.compare import load_text
    from pagevis.presets import DEFAULT_CONFIG, Preset, shipped_text

    load_text(path)  # a UsageError now, not a message in the window later
    text = path if shipped_text(path) is not None else os.path.abspath(path)
    if preset is not None and preset.b is not None:
        return replace(preset, text=text)
    a = config or (preset.a if preset is not None else DEFAULT_CONFIG)
    b = replace(a, policy="oldest" if a.policy != "oldest" else "sinks", policy_params={})
    return Preset(f"same text: {os.path.basename(path)}", "", "explain-paging", a, b, text=text)


def launch_server_demo(args: argparse.Namespace, spec, recording=None) -> int:
    """`pagevis --server-demo [PRESET]`: the Server window alone (SmolLM2 unless a model is given)."""
    from pagevis.kvcache import ConfigError
    from pagevis.presets import find_server_preset

    if args.server_events or args.server_metrics:
        if args.screenshot or recording is not None:
            raise UsageError("--screenshot and --record show the Server window's own servers, not an attached one")
        from pagevis.gui import launch_attached_server

        return launch_attached_server(spec, args.server_events, args.server_metrics)
    if recording is not None and recording.view is not None:
        raise UsageError("--record-view records a view of the main window, not of the Server window")
    try:
        preset = find_server_preset(args.server_demo)
    except ConfigError as error:
        raise UsageError(f"--server-demo {args.server_demo!r}: {error.allowed}") from None
    from pagevis.gui import launch_server

    return launch_server(model_spec=spec, preset=preset, screenshot=args.screenshot, steps=args.steps,
                         recording=recording)

"""`pagevis attach ENDPOINT[,REPLAY] ...`: a vLLM / SGLang engine's prefix cache from its KV events.

Headless (`--headless`) it runs until --duration, --idle-exit or Ctrl-C and prints a summary (`--json`: the object
issue 20 fixes, see pagevis/attach/report.py); otherwise it opens the attach window (pagevis.gui.attach.window,
imported only then) with the same validated arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from pagevis.cli.options import UsageError

MAX_DP = 1024
MAX_ENDPOINTS = 1024
EXPLAIN_FLAGS = (
    ("--explain", "a JSON request a line ({\"prompt\"}, {\"prompt_token_ids\"} or {\"messages\"}, optional cache_salt, "
                  "lora_name; - for stdin): how much of each the engines' caches hold, where and why the rest "
                  "misses, which engine it should go to"),
    ("--explain-log", "with --play: each request of a `pagevis serve --request-log` file against the pool as it was "
                      "at its arrival; flags cached tokens that differ from what the pool held"))


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "attach", help="show a vLLM / SGLang engine's KV cache from its ZMQ KV events",
        description="Subscribe to the KV events a vLLM or SGLang engine publishes (vLLM: --kv-events-config "
                    "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"topic\": \"kv-events\"}') and "
                    "rebuild its prefix cache: live, after a late attach (from the replay endpoint), across gaps "
                    "and restarts.")
    parser.add_argument("endpoints", nargs="*", metavar="ENDPOINT[,REPLAY]",
                        help="the engine's PUB endpoint (tcp://HOST:5557), optionally with its replay ROUTER "
                             "endpoint after a comma; one per engine")
    parser.add_argument("--topic", help="the topic the engine publishes on (vLLM's \"topic\"; default: any)")
    parser.add_argument("--dp-size", type=int, default=1, metavar="N",
                        help="data parallel ranks per endpoint: rank r publishes on port + r (and replays on "
                             "replay port + r)")
    parser.add_argument("--play", metavar="FILE", help="play a recording (--record) instead of endpoints")
    parser.add_argument("--record", metavar="FILE", help="record every frame received to FILE (scrub it later "
                                                         "with --play)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (needs `tokenizers`) or a .gguf: "
                                                            "show each block's text")
    parser.add_argument("--metrics", metavar="URL", help="the engine's Prometheus /metrics URL (vllm: names)")
    group = parser.add_argument_group("headless")
    group.add_argument("--headless", action="store_true", help="no window: run, then print a summary")
    group.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    stop = group.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    stop.add_argument("--idle-exit", type=float, metavar="S", help="stop after S seconds without a message")
    group.add_argument("--save-state", metavar="FILE",
                       help="write every endpoint's resident blocks as JSON at exit (hash, parent, medium, tokens; "
                            "and text with --tokenizer)")
    why = parser.add_argument_group("explain (headless, JSON a line)")
    for flag, text in EXPLAIN_FLAGS:
        why.add_argument(flag, metavar="FILE", help=text)
    parser.set_defaults(handler=main)
    return parser


def sources_from_args(args: argparse.Namespace) -> list:
    from pagevis.attach.subscriber import expand_dp, parse_source

    if not 1 <= args.dp_size <= MAX_DP:
        raise UsageError(f"pagevis attach: --dp-size {args.dp_size}: give 1 to {MAX_DP}")
    if args.play:
        if args.endpoints:
            raise UsageError("pagevis attach: give endpoints or --play FILE, not both")
        return []
    if not args.endpoints:
        raise UsageError("pagevis attach: give at least one ENDPOINT (e.g. tcp://HOST:5557,tcp://HOST:5558)")
    sources = []
    try:
        for text in args.endpoints:
            sources += expand_dp(parse_source(text, args.topic or ""), args.dp_size)
    except ValueError as error:
        raise UsageError(f"pagevis attach: {error}") from None
    if len(sources) > MAX_ENDPOINTS:
        raise UsageError(f"pagevis attach: {len(sources)} endpoints; at most {MAX_ENDPOINTS}")
    return sources


def check_args(args: argparse.Namespace) -> None:
    from pagevis.cli.options import check_writable

    for flag, value in (("--duration", args.duration), ("--idle-exit", args.idle_exit)):
        if value is not None and not 0 < value <= 7 * 86400:
            raise UsageError(f"pagevis attach: {flag} {value}: give seconds between 0 and a week")
    explaining = bool(args.explain or args.explain_log)
    if (args.save_state or args.duration) and explaining:
        raise UsageError("pagevis attach: --explain and --explain-log print their own JSON; no --save-state, "
                         "--duration")
    if (args.json or args.save_state or args.duration or args.idle_exit) and not (args.headless or explaining):
        raise UsageError("pagevis attach: --json, --save-state, --duration and --idle-exit go with --headless")
    if args.explain and args.explain_log:
        raise UsageError("pagevis attach: give --explain or --explain-log, not both")
    if args.explain_log and not args.play:
        raise UsageError("pagevis attach: --explain-log explains a request log against a recording: give --play")
    for flag, path in (("--explain", args.explain), ("--explain-log", args.explain_log)):
        if path and path != "-" and not os.path.isfile(path):
            raise UsageError(f"pagevis attach: {flag} {path}: no such file")
    for flag, path in (("--save-state", args.save_state), ("--record", args.record)):
        if path:
            check_writable(path, flag)
    if args.record and args.play:
        raise UsageError("pagevis attach: --record records endpoints; it does not go with --play")
    if args.metrics and not args.metrics.startswith(("http://", "https://")):
        raise UsageError(f"pagevis attach: --metrics {args.metrics}: give an http:// URL")


def main(args: argparse.Namespace) -> int:
    sources = sources_from_args(args)
    check_args(args)
    detokenizer = tokenizer = None
    if args.tokenizer:
        from pagevis.attach.tokens import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except ValueError as error:
            raise UsageError(f"pagevis attach: {error}") from None
        detokenizer = tokenizer.decode
    playback = None
    if args.play:
        from pagevis.attach.recording import RecordingError, read_recording
        from pagevis.attach.playback import Playback

        try:
            playback = Playback(read_recording(args.play))
        except (RecordingError, OSError) as error:
            raise UsageError(f"pagevis attach: --play {args.play}: {error}") from None
    if args.explain or args.explain_log:
        return run_explain(args, sources, playback, tokenizer)
    if not args.headless:
        try:
            from pagevis.gui.attach import window as attach_window
        except ImportError:
            raise UsageError("pagevis attach: the attach window is not part of this pagevis yet; "
                             "use --headless (--json) for now") from None
        return attach_window.launch(sources=sources, playback=playback, detokenizer=detokenizer,
                                    metrics_url=args.metrics, record=args.record, tokenizer=tokenizer)
    return run_headless(args, sources, playback, detokenizer)


def run_headless(args, sources, playback, detokenizer) -> int:
    import zmq

    from pagevis.attach import report
    from pagevis.attach.recording import Recorder
    from pagevis.attach.subscriber import Attacher

    metrics = _Metrics(args.metrics)
    if playback is not None:
        playback.seek(len(playback))
        fleet, replays = playback.fleet, [None] * len(playback.fleet.engines)
    else:
        recorder = None
        if args.record:
            recorder = Recorder(args.record, [s.endpoint for s in sources],
                                {"replays": [s.replay for s in sources], "topic": args.topic})
        attacher = Attacher(sources, recorder=recorder)
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            attacher.start()
            _print_history(attacher.fleet)
            metrics.scrape()
            attacher.run(duration=args.duration, idle_exit=args.idle_exit, stop=stop)
        except KeyboardInterrupt:
            pass
        except zmq.ZMQError as error:
            raise UsageError(f"pagevis attach: {error}") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
            attacher.close()
            if recorder is not None:
                recorder.close()
        fleet, replays = attacher.fleet, [s.replay for s in sources]
    metrics.scrape()
    metrics.print()
    snapshot = fleet.snapshot(blocks=bool(args.save_state))
    if args.save_state:
        saved = report.state(snapshot)
        if detokenizer is not None:
            for endpoint in saved["endpoints"]:
                for block in endpoint["blocks"]:
                    block["text"] = detokenizer(block["tokens"])
        _write_json(args.save_state, saved)
    summary = report.summary(snapshot, replays)
    if args.json:
        print(json.dumps(summary))
    else:
        for item in summary["endpoints"]:
            resident = ", ".join(f"{n} {m}" for m, n in item["resident_blocks"].items()) or "none"
            print(f"{item['endpoint']}: {item['batches']} batches (last seq {item['last_seq']}, "
                  f"{item['replayed_batches']} replayed), resident blocks: {resident}; "
                  f"{item['gaps_unrecovered']} gaps unrecovered, {item['decode_errors']} decode errors")
        print(f"GPU blocks held by two or more endpoints: {summary['shared_blocks']}")
    return 0


def run_explain(args, sources, playback, tokenizer) -> int:
    """--explain / --explain-log: rebuild the pools (replay, then the live stream until --idle-exit, default 1 s;
    or the whole recording), then one JSON object a request on stdout."""
    from pagevis.attach import explain_run

    def opened(path: str):
        return sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")

    if args.explain_log:
        with opened(args.explain_log) as file:
            flagged, refused = explain_run.explain_log(file, playback, tokenizer, sys.stdout)
        print(f"pagevis attach: {flagged} requests flagged (cached tokens differ from what the pool held); "
              f"{refused} lines refused", file=sys.stderr)
        return 1 if refused else 0
    if playback is not None:
        playback.seek(len(playback))
        engines = explain_run.fleet_engines(playback.fleet)
    else:
        engines = _attach_for_explain(sources, args.idle_exit or 1.0, args.dp_size)
    with opened(args.explain) as file:
        refused = explain_run.explain_file(file, engines, tokenizer, sys.stdout)
    return 1 if refused else 0


def _attach_for_explain(sources, idle_exit: float, dp_size: int):
    import zmq

    from pagevis.attach import explain_run
    from pagevis.attach.subscriber import Attacher

    attacher = Attacher(sources)
    try:
        attacher.start()
        _print_history(attacher.fleet)
        attacher.run(idle_exit=idle_exit)
    except KeyboardInterrupt:
        pass
    except zmq.ZMQError as error:
        raise UsageError(f"pagevis attach: {error}") from None
    finally:
        attacher.close()
    return explain_run.fleet_engines(attacher.fleet, [i % dp_size for i in range(len(sources))])


def _print_history(fleet) -> None:
    for engine in fleet.engines:
        c = engine.counters()
        if c.history_from_seq is None and c.history_missing is None:
            continue
        if c.history_batches == 0:
            print(f"pagevis attach: {engine.name}: the replay buffer was empty", file=sys.stderr)
            continue
        whole = "the whole history" if c.history_missing == 0 else f"{c.history_missing} earlier batches lost"
        print(f"pagevis attach: {engine.name}: rebuilt from {c.history_batches} replayed batches (seqs "
              f"{c.history_from_seq}-{c.last_seq}; {whole})", file=sys.stderr)


def _write_json(path: str, value: dict) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(value, file)
    os.replace(temporary, path)


class _Metrics:
    def __init__(self, url: str | None):
        from pagevis.attach.metrics import MetricsHistory

        self.url, self.history, self.error = url, MetricsHistory(), None

    def scrape(self) -> None:
        if not self.url:
            return
        from pagevis.attach.metrics import scrape

        try:
            self.history.add(scrape(self.url))
        except (OSError, ValueError) as error:
            self.error = str(error)[:200]

    def print(self) -> None:
        if not self.url:
            return
        if not self.history.samples:
            print(f"pagevis attach: --metrics {self.url}: {self.error}", file=sys.stderr)
            return
        last, rate = self.history.samples[-1], self.history.hit_rate()
        parts = [f"{name} {value:g}" for name, value in (("running", last.running), ("waiting", last.waiting))
                 if value is not None]
        if last.kv_usage is not None:
            parts.append(f"KV usage {100 * last.kv_usage:.1f}%")
        if rate is not None:
            parts.append(f"prefix hit rate {100 * rate:.1f}%")
        print(f"pagevis attach: metrics: {', '.join(parts) or 'no vllm: metrics found'}", file=sys.stderr)

"""`pagevis bench`'s subcommands: `weights`, `engine`, `serve` and `startup`, each with its own options (plain
`pagevis bench` runs the attention and model suite: cli/bench.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagevis import settings
from pagevis.cli import options
from pagevis.cli.options import UsageError

MAX_DECODE_TOKENS = 10_000


def add_parsers(parser: argparse.ArgumentParser) -> None:
    """The subcommands, under `parser` (the `bench` command's); listed in its `subcommands`, which cli/main.py
    gives the options every command has."""
    targets = parser.add_subparsers(dest="target", metavar="{weights,engine,serve,startup}",
                                    parser_class=type(parser),
                                    title="subcommands (pagevis bench SUBCOMMAND --help: its options)")
    parser.subcommands = (_weights_parser(targets), _engine_parser(targets), _serve_parser(targets),
                          _startup_parser(targets))


def _common(sub: argparse.ArgumentParser, handler, decode: int | None, rounds: bool = False) -> argparse.ArgumentParser:
    """The options every subcommand has (and --decode-tokens, --rounds where it measures them); its handler."""
    sub.set_defaults(handler=handler)
    if rounds:
        sub.add_argument("--rounds", type=int, default=3, metavar="N",
                         help="interleaved rounds, each configuration in its own process (3)")
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    if decode is not None:
        sub.add_argument("--decode-tokens", type=int, default=decode, metavar="N",
                         help=f"decode steps to time ({decode})")
    return sub


def _weights_parser(targets) -> argparse.ArgumentParser:
    sub = targets.add_parser(
        "weights", help="decode, prefill, batches and peak RSS with the weights as the GGUF stores them",
        description="The bare model (model.forward with a dense attention) with the weights as the GGUF stores them, "
                    "beside --weights float32 and llama.cpp (the bench extra): decode after 23 and 512 prompt tokens, "
                    "prefill, batches of 8 and 16 and peak RSS, SmolLM2, Gemma 3 270M (when installed) and a "
                    "synthetic 1B Q4_K_M file; every configuration in its own process, rounds interleaved.")
    return _common(sub, weights_main, 32, rounds=True)


def _engine_parser(targets) -> argparse.ArgumentParser:
    sub = targets.add_parser(
        "engine", help="pagevis run's decode (paged cache, scheduler, record) beside the bare model and llama.cpp",
        description="Decode as `pagevis run --no-chat --policy none --page-size 16` does (the paged cache, the "
                    "scheduler, the step record, the run loop), beside the bare model.forward with a dense attention "
                    "and llama.cpp (the bench extra), on 1 and 2 threads, after each prompt length: decode and "
                    "prefill tokens/s (wall clock, from the first decoded token to the last), peak RSS, and the ms "
                    "of a token by part (weights, attention, the rest of the forward, sampling, the scheduler and "
                    "cache bookkeeping, the record, the Python between steps). Every configuration in its own "
                    "process, rounds interleaved, medians.")
    sub.add_argument("--models", default="smollm2,gemma3-270m", metavar="LIST",
                     help="smollm2, gemma3-270m or .gguf paths (default smollm2,gemma3-270m; one not installed is "
                          "skipped)")
    sub.add_argument("--prompts", default="23,512", metavar="LIST", help="prompt lengths in tokens (23,512)")
    sub.add_argument("--thread-counts", default="1,2", metavar="LIST", help="weight threads to measure (1,2)")
    sub.add_argument("--policies", metavar="LIST", help="instead: each policy's decode (all: every token policy) in "
                     "16 pages of 16 after a 512-token text (--prompts' first), the cache full every step, one thread, "
                     "the first of --models, against sinks in the same rounds; NAME:KEY=VALUE[:KEY=VALUE] sets "
                     "parameters, as in compare (all adds expected-attention:compress_every=1: scored every token, "
                     "not every 10)")
    return _common(sub, engine_main, 64, rounds=True)


def _serve_parser(targets) -> argparse.ArgumentParser:
    sub = targets.add_parser(
        "serve", help="pagevis serve under a chat workload (shaped like vLLM's benchmark_serving)",
        description="Benchmark `pagevis serve`: a chat workload at concurrency 1-16 or Poisson rates, shaped like "
                    "vLLM's benchmark_serving; --overhead: HTTP against the engine called directly; --hostile: "
                    "eight clients' latency while one sends the worst requests.")
    sub.add_argument("--model", metavar="MODEL", help="smollm2 (default) or synthetic")
    sub.add_argument("--concurrency", metavar="LIST", help="concurrent streaming clients per level (default "
                     "1,2,4,8,16)")
    sub.add_argument("--request-rate", metavar="LIST", help="Poisson arrivals, requests/s per level (instead of "
                     "the concurrency levels, or after those given with --concurrency)")
    sub.add_argument("--num-prompts", type=int, metavar="N", help="requests per level (default 2 x the "
                     "concurrency, at least 4; 16 per rate)")
    sub.add_argument("--output-tokens", type=int, default=32, metavar="N", help="tokens each request decodes (32)")
    sub.add_argument("--rounds", type=int, default=1, metavar="N", help="run the levels N times in turn, against one "
                     "server (1); 8 clients over 1 is of the medians")
    sub.add_argument("--overhead", action="store_true", help="instead: HTTP against the engine called directly "
                     "(tokens/s, /healthz while sessions decode, /v1/attention)")
    sub.add_argument("--hostile", action="store_true", help="instead: eight clients' chat latency on an idle "
                     "server and while one client sends the worst requests (2 MB stop strings, lone surrogates, "
                     "1.1 M characters of content, injected control tokens), phases alternating")
    sub.add_argument("--no-bare", action="store_true", help="with 1 and 8 clients among the levels, the bench also "
                     "runs the same kind of requests in the engine alone (no HTTP) after each round and says the "
                     "server's c8/c1 over the engine's; this skips that")
    sub.add_argument("--int8-rows", choices=settings.INT8_ROWS, help="the server's --int8-rows (and the engine "
                     "alone's); default: serve's")
    sub.add_argument("--dtype", choices=settings.STORAGE_DTYPES, help="the server's --dtype, its K/V storage (and "
                     "the engine alone's); default: serve's (float32)")
    sub.add_argument("--out", default=".", metavar="DIR", help="folder for bench-serve.png (default .)")
    sub.add_argument("--no-files", action="store_true", help="write no PNG")
    return _common(sub, serve_main, 32)


def _startup_parser(targets) -> argparse.ArgumentParser:
    sub = targets.add_parser("startup", help="the app's time to its first drawn frame, cold and warm, by phase",
                             description="`pagevis` to its first drawn frame, cold and warm, by phase.")
    sub.add_argument("--model", metavar="MODEL", help="smollm2 (default), synthetic or a .gguf path")
    sub.add_argument("--starts", type=int, default=2, metavar="N", help="warm starts to time (default 2)")
    sub.add_argument("--no-cold", action="store_true",
                     help="no cold start (the model and the app's packages dropped from the page cache first)")
    return _common(sub, startup_main, None)


def _say(args) -> callable:
    return (lambda text: print(text, file=sys.stderr)) if not args.json else (lambda text: None)


def _check_rounds_and_tokens(args: argparse.Namespace) -> None:
    options.check_range("--rounds", args.rounds, 1, 20)
    options.check_range("--decode-tokens", args.decode_tokens, 1, MAX_DECODE_TOKENS)


def weights_main(args: argparse.Namespace) -> int:
    from pagevis.bench import weights

    _check_rounds_and_tokens(args)
    result = weights.run_bench(args.rounds, args.decode_tokens, say=lambda text: print(text, file=sys.stderr))
    print(json.dumps(result) if args.json else weights.format_report(result))
    return 0


def engine_main(args: argparse.Namespace) -> int:
    from pagevis.bench import engine
    from pagevis.bench.machine import load_average

    _check_rounds_and_tokens(args)
    prompts = options.parse_int_list(args.prompts, "--prompts", "numbers like 23,512")
    if any(not 1 <= n <= 32_768 for n in prompts):
        raise UsageError(f"--prompts {args.prompts!r}: each must be from 1 to 32768")
    threads = options.parse_int_list(args.thread_counts, "--thread-counts", "1, 2 or 1,2")
    if any(t not in (1, 2) for t in threads):
        raise UsageError(f"--thread-counts {args.thread_counts!r}: 1, 2 or 1,2")
    models = tuple(m for m in args.models.split(",") if m)
    for model in models:
        if model not in ("smollm2", "gemma3-270m") and not os.path.isfile(model):
            raise UsageError(f"--models: {model}: smollm2, gemma3-270m or the path of a .gguf file")
    say = _say(args)
    say(f"load average {load_average()}; each configuration in its own process ...")
    if args.policies:
        return _policies_main(args, models[0] if models else "smollm2", prompts, say)
    result = engine.run_bench(args.rounds, args.decode_tokens, models, tuple(prompts), tuple(threads), say=say)
    print(json.dumps(result) if args.json else engine.format_report(result))
    return 0


def _policies_main(args: argparse.Namespace, model: str, prompts: list[int], say) -> int:
    from pagevis.bench import engine
    from pagevis.kvcache.policies import POLICIES

    policies = engine.TOKEN_POLICIES
    if args.policies != "all":
        items = [item for item in args.policies.split(",") if item.strip()]
        policies = tuple(engine.PolicyRun(item, *options.parse_policy_item(item, "--policies")) for item in items)
    for policy in policies:
        if policy.name not in POLICIES:
            raise UsageError(f"--policies: {policy.label}: all, or names from {', '.join(POLICIES)}, each alone or "
                             "as NAME:KEY=VALUE[:KEY=VALUE] (its parameters set, e.g. "
                             "expected-attention:compress_every=1)")
        engine.policy_config(policy.name, policy.params, 1).check()  # a bad parameter: one line, before any run
    prompt = prompts[0] if args.prompts != "23,512" else 512
    if prompt <= engine.POLICY_PAGES * engine.PAGE_SIZE:
        raise UsageError(f"--prompts {prompt}: with --policies, more than the cache's "
                         f"{engine.POLICY_PAGES * engine.PAGE_SIZE} tokens (so that every step evicts)")
    result = engine.run_policy_bench(args.rounds, args.decode_tokens, model, policies, prompt, say=say)
    print(json.dumps(result) if args.json else engine.format_policy_report(result))
    return 0


def startup_main(args: argparse.Namespace) -> int:
    """`pagevis bench startup`: `pagevis` to its first drawn frame, cold and warm, by phase (bench/gui/startup.py)."""
    from pagevis.bench.gui.startup import format_rows, run_startup_bench

    model = args.model or "smollm2"
    options.check_range("--starts", args.starts, 1, 20)
    if model not in ("smollm2", "synthetic") and not os.path.isfile(model):
        raise UsageError(f"--model {model}: smollm2, synthetic or the path of a .gguf file")
    rows = run_startup_bench(model, args.starts, cold=not args.no_cold)
    print(json.dumps(rows) if args.json else format_rows(rows, model))
    return 0


def serve_main(args: argparse.Namespace) -> int:
    """`pagevis bench serve`: the serving benchmark (or --overhead); a table on stdout, a PNG plot."""
    from pagevis.bench import serve, serving

    model = args.model or "smollm2"
    if model not in ("smollm2", "synthetic"):
        raise UsageError(f"pagevis bench serve: --model {model}: smollm2 or synthetic")
    say = _say(args)
    if args.overhead:
        result = serve.overhead(model, args.decode_tokens, 3)
        print(json.dumps(result) if args.json else serve.format_overhead(result))
        return 0
    if args.hostile:
        result = serve.hostile(model)
        print(json.dumps(result) if args.json else serve.format_hostile(result))
        return 0
    rates = _rates(args.request_rate) if args.request_rate else None
    concurrencies = _counts(args.concurrency) if args.concurrency else (None if rates else [1, 2, 4, 8, 16])
    if args.num_prompts is not None:
        options.check_range("--num-prompts", args.num_prompts, 1, 100_000)
    options.check_range("--output-tokens", args.output_tokens, 1, 4096)
    options.check_range("--rounds", args.rounds, 1, 100)
    if not args.no_files:
        if not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out}: no such folder")
        options.check_writable(os.path.join(args.out, "bench-serve.png"), "--out")
    say(f"load average {os.getloadavg()[0]:.1f}; starting pagevis serve --model {model} ...")
    say("  ".join(serving.HEADER))
    # --threads: the server's weight threads (its default: every core, up to 2)
    flags = serving.SERVER_FLAGS + (() if args.threads is None else ("--threads", str(args.threads)))
    result = serving.run(model, concurrencies, rates, args.num_prompts, args.output_tokens, progress=say,
                         rounds=args.rounds, flags=flags, bare=not args.no_bare, int8_rows=args.int8_rows,
                         dtype=args.dtype)
    if not args.no_files:
        from pagevis.plots import line_plot

        result["files"] = serving.plot(result, args.out, line_plot)
    if args.json:
        print(json.dumps(result))
        return 0
    print(serving.format_table(result))
    if result.get("files"):
        print("wrote " + ", ".join(result["files"]))
    return 0


def _counts(text: str) -> list[int]:
    values = options.parse_int_list(text, "--concurrency", "numbers like 1,2,4")
    if any(not 1 <= v <= 256 for v in values):
        raise UsageError(f"--concurrency {text!r}: each must be from 1 to 256")
    return values


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--request-rate {text!r}: numbers like 1,2,4") from None
    if not rates or any(not 0 < r <= 1000 for r in rates):
        raise UsageError(f"--request-rate {text!r}: each must be more than 0 and at most 1000")
    return rates

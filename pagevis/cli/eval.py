"""`pagevis eval`: lm-eval tasks against an in-process `pagevis serve`, per policy x budget x dtype; a table
like compare's, a PNG plot per task and, for the needle task, a depth x length heatmap per row."""

from __future__ import annotations

import argparse
import json
import sys

from pagevis import settings
from pagevis.cli import options
from pagevis.cli.options import UsageError, add_report_options
from pagevis.kvcache.config import STORAGE_DTYPES

DEFAULT_TASKS = "pagevis_mc,pagevis_ppl,pagevis_needle"
DEFAULT_POLICIES = "sinks,h2o"
MAX_LIMIT = 1 << 20
MAX_CONCURRENCY = 64
MAX_LENGTH = 8192
CHOICE_ROOM = 16  # tokens a needle choice (" 1234.") and lm-eval's own one token may take


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "eval", help="lm-eval tasks through the paged cache, per policy, budget and dtype (needs pagevis[eval])",
        description="Run lm-eval tasks (local-completions, remote tokenizer) against an in-process pagevis serve, "
                    "once with the full cache and once per policy x budget x dtype, every prompt scored through "
                    "that cache; print a table of each task's metric per row, write a PNG plot per task and the "
                    "needle task's depth x length heatmaps. The shipped tasks run offline: pagevis_mc (multiple "
                    "choice), pagevis_ppl (perplexity of a shipped text), pagevis_needle (a code hidden in a "
                    "haystack of shipped text); any other lm-eval task name runs where the machine has its data.")
    options.add_model_options(parser)
    parser.add_argument("--tasks", default=DEFAULT_TASKS, metavar="LIST",
                        help=f"comma-separated lm-eval task names (default {DEFAULT_TASKS})")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, metavar="LIST",
                        help=f"policies, each optionally name:key=value (default {DEFAULT_POLICIES}); the full "
                             "cache's row is always first")
    parser.add_argument("--budgets", default="64,128", metavar="LIST",
                        help="cache budgets in tokens per layer, multiples of the page size (default 64,128)")
    settings.add_flags(parser, names=("page_size", "residual"), page_size=16)
    parser.add_argument("--dtypes", default="float32", metavar="LIST",
                        help=f"K/V storages, comma-separated (any of {', '.join(STORAGE_DTYPES)}; default float32)")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N documents of each task (default all)")
    parser.add_argument("--max-length", type=int, default=512, metavar="N",
                        help="tokens of one request (lm-eval cuts contexts and rolling windows to it; default 512)")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N",
                        help="requests in flight at once, batched in the engine's steps (default 8)")
    parser.add_argument("--needle-lengths", default="128,256", metavar="LIST",
                        help="pagevis_needle: prompt lengths in tokens, at most --max-length - 16 (default 128,256)")
    parser.add_argument("--needle-depths", default="0,0.5,1", metavar="LIST",
                        help="pagevis_needle: depths of the code in the haystack, 0 (start) to 1 (end) (default 0,0.5,1)")
    parser.add_argument("--needle-samples", type=int, default=2, metavar="N",
                        help="pagevis_needle: documents per depth and length (default 2)")
    parser.add_argument("--plot", default="eval", metavar="PREFIX",
                        help="PNG files PREFIX-TASK.png per task and PREFIX-needle.png (default eval)")
    add_report_options(parser, "no plots", "no progress lines")
    parser.set_defaults(handler=main)
    return parser


def parse_plan(args: argparse.Namespace, model_config):
    """The evaluation plan from the flags; UsageError naming the flag that is wrong."""
    from pagevis.cli.compare import parse_budgets, parse_policies
    from pagevis.eval.run import Configuration, Plan
    from pagevis.eval.tasks import MAX_NEEDLE_TOKENS, Needle

    options.check_range("--max-length", args.max_length, 16, MAX_LENGTH)
    options.check_range("--concurrency", args.concurrency, 1, MAX_CONCURRENCY)
    options.check_range("--needle-samples", args.needle_samples, 1, 1000)
    if args.limit is not None:
        options.check_range("--limit", args.limit, 1, MAX_LIMIT)
    tasks = tuple(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))
    if not tasks:
        raise UsageError("--tasks: give at least one task")
    choices = parse_policies(args.policies, optimal=False)
    for choice in choices:
        if choice.name in ("optimal", "quest", "disk"):
            raise UsageError(f"--policies: {choice.name} is a compare row, not a policy a server request can use")
    budgets = parse_budgets(args.budgets, args.page_size)
    dtypes = list(dict.fromkeys(d.strip() for d in args.dtypes.split(",") if d.strip()))
    for dtype in dtypes or [""]:
        if dtype not in STORAGE_DTYPES:
            raise UsageError(f"--dtypes: unknown dtype {dtype!r}; the dtypes are {', '.join(STORAGE_DTYPES)}")
    lengths = tuple(options.parse_int_list(args.needle_lengths, "--needle-lengths", "token counts like 128,256"))
    for length in lengths:  # the longest choice must fit after the prompt, or lm-eval cuts the haystack's start
        options.check_range("--needle-lengths", length, 32, min(args.max_length - CHOICE_ROOM, MAX_NEEDLE_TOKENS))
    depths = tuple(_parse_depths(args.needle_depths))
    residual = settings.setting("residual").default if args.residual is None else args.residual
    options.check_range("--residual", residual, 0, settings.MAX_RESIDUAL)
    configurations = tuple(Configuration(c.name, budget, dtype, dict(c.params))
                           for dtype in dtypes for c in choices for budget in budgets)
    return Plan(tasks, configurations, page_size=args.page_size, max_length=args.max_length, limit=args.limit,
                concurrency=args.concurrency, residual=residual,
                needle=Needle(lengths=lengths, depths=depths, samples=args.needle_samples))


def _parse_depths(text: str) -> list[float]:
    try:
        depths = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--needle-depths {text!r}: expected numbers from 0 to 1, like 0,0.5,1") from None
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise UsageError(f"--needle-depths {text!r}: expected numbers from 0 to 1, like 0,0.5,1")
    return sorted(set(depths))


def main(args: argparse.Namespace) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("pagevis eval needs lm-eval: pip install 'pagevis[eval]'") from None
    from pagevis.eval import report
    from pagevis.eval.run import UnknownTask, evaluate

    spec = options.model_spec(args)
    if not args.no_files:
        options.check_writable(f"{args.plot}-needle.png", "--plot", suffix=".png")
    model = spec.load()
    plan = parse_plan(args, model.config)
    if model.tokenizer is None:
        raise UsageError(f"--model {spec.label}: it has no tokenizer, so lm-eval cannot send it text")
    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    try:
        rows = evaluate(model, spec, plan, log)
    except UnknownTask as error:
        raise UsageError(f"--tasks: {error}") from None
    result = {"model": spec.label, "tasks": list(plan.tasks), "page_size": plan.page_size,
              "max_length": plan.max_length, "limit": plan.limit, "rows": [row.as_dict() for row in rows]}
    if not args.no_files:
        result["files"] = report.write_plots(args.plot, rows, plan, spec.label)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"{spec.label}, page size {plan.page_size}, at most {plan.max_length} tokens a request"
              + (f", {plan.limit} documents a task" if plan.limit else ""))
        print(report.format_table(rows, plan.tasks))
        if not args.no_files:
            print(f"wrote {', '.join(result['files'])}", file=sys.stderr)
    return 0

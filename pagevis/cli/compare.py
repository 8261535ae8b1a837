"""`pagevis compare [TEXTFILE]`: perplexity and oracle metrics per policy and cache budget, teacher-forced."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from importlib import resources

from pagevis import settings
from pagevis.cli import options
from pagevis.kvcache.config import MAX_PAGE_SIZE, MAX_PAGES, STORAGE_DTYPES
from pagevis.kvcache.quant import has_residual
from pagevis.cli.options import UsageError, add_report_options
from pagevis.cli.progress import Progress

DEFAULT_TEXT = "texts/pride-and-prejudice-ch1.txt"
LONG_TEXT = "pride-and-prejudice-ch1-6"  # about 10,100 SmolLM2 tokens: enough for --tokens 8192
DEFAULT_POLICIES = "sinks,oldest,h2o,tova,snapkv,pyramidkv,lru,lfu"
MAX_TOKENS = 1 << 20  # the reference's logits go to temporary files; the text bounds it in practice
COLUMNS = ("policy", "budget", "page_size", "dtype", "kv_bytes_per_token", "kv_bytes", "kv_bytes_peak_per_token",
           "equal_memory_to", "ppl", "ppl_evicting", "full_ppl_evicting", "gap_to_optimal", "mean_kl",
           "top1_agreement", "lost_attention", "evictions", "evicting_tokens", "seconds", "note", "recall",
           "residual", "storage_notice", "mean_resident", "kv_bytes_held", "key_channels", "scored_from",
           "optimal_ppl_scored")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "compare", help="perplexity and oracle metrics per policy and cache budget on a text",
        description="Teacher-forced evaluation: feed a text through the paged cache under each policy and "
                    "budget, and report perplexity and the oracle metrics (KL, top-1 agreement, lost attention) "
                    "against the full cache. Prints a table, writes a CSV and a PNG plot of perplexity vs budget. "
                    "KL, top-1 and lost attention are means over the tokens predicted once the cache was full; "
                    "ppl_evicting is the perplexity over those tokens, beside the full cache's on the same tokens.")
    parser.add_argument("text", nargs="?", metavar="TEXTFILE",
                        help=f"a UTF-8 text file, or the name of a shipped text: {LONG_TEXT} (chapters 1-6, 10,100 "
                             f"tokens) (default: chapter 1 of Pride and Prejudice, shipped, 1,100 tokens)")
    options.add_model_options(parser)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, metavar="LIST",
                        help=f"comma-separated policies, each optionally with parameters as "
                             f"name:key=value[:key=value], e.g. sinks:n_sink=1 (default {DEFAULT_POLICIES}); "
                             f"'optimal' is always added unless --no-optimal. Disk-tier rows: 'quest' (RAM = the "
                             f"budget, the whole text on disk, budget/page-size pages read per token by key "
                             f"bounds; quest:select_pages=K) and 'disk' (the same tiers, every page read: exact); "
                             f"both take disk_pages=N. key_channels=R on any row prunes that share of key "
                             f"channels (ThinK), e.g. sinks,sinks:key_channels=0.5")
    parser.add_argument("--no-optimal", action="store_true",
                        help="skip the clairvoyant 'optimal' rows (then no row has a gap to optimal)")
    parser.add_argument("--tmp-dir", metavar="DIR",
                        help="folder for the full cache's reference files (default: the system's temporary "
                             "folder; about 3.6 GB at 8,192 tokens of SmolLM2, deleted at the end)")
    parser.add_argument("--budgets", default="64,128,256", metavar="LIST",
                        help="cache budgets in tokens per layer, multiples of the page size (default 64,128,256)")
    # pages of 16, compare's own default: docs/compare.md's tables are measured with them
    settings.add_flags(parser, names=("page_size", "dtype", "residual"), page_size=16, dtype="float32")
    parser.add_argument("--dtypes", metavar="LIST",
                        help=f"K/V storages to compare, comma-separated (any of {', '.join(STORAGE_DTYPES)}): a row "
                             f"per dtype x policy x budget (default: --dtype alone). Quality is always measured "
                             f"against the float32 full cache")
    parser.add_argument("--equal-memory", metavar="DTYPE",
                        help="also add, for each budget and each other dtype, the rows of the largest budget whose "
                             "K/V bytes (kv_bytes: pages, scales, zero points, the residual window) do not exceed "
                             "DTYPE's at that budget, e.g. --equal-memory float16: 'keep more tokens at 4 bits, or "
                             "evict?' (DTYPE is added to --dtypes)")
    parser.add_argument("--tokens", type=int, default=512, metavar="N",
                        help="evaluate the first N tokens of the text (default 512)")
    parser.add_argument("--csv", default="compare.csv", metavar="FILE", help="CSV output (default compare.csv)")
    parser.add_argument("--plot", default="compare.png", metavar="FILE",
                        help="PNG plot of perplexity vs budget (default compare.png)")
    add_report_options(parser, "neither the CSV nor the plot", "no progress bar")
    parser.set_defaults(handler=main)
    return parser


def parse_policies(text: str, optimal: bool = True):
    """The policies to compare; the clairvoyant `optimal` comes first (unless not wanted), once."""
    from pagevis.quality.optimal import OPTIMAL
    from pagevis.quality.measure import TIER_ROWS, PolicyChoice
    from pagevis.kvcache import POLICIES

    choices = [PolicyChoice(OPTIMAL)] if optimal else []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, params = options.parse_policy_item(item, "--policies")
        if name == OPTIMAL and not params:
            choices[:0] = [] if choices[:1] == [PolicyChoice(OPTIMAL)] else [PolicyChoice(OPTIMAL)]
            continue
        if name not in POLICIES and name not in TIER_ROWS:
            raise UsageError(f"--policies: unknown policy {name!r}; the policies are {', '.join(POLICIES)}, "
                             f"{OPTIMAL} (compare only, no parameters) and the disk-tier rows "
                             f"{', '.join(TIER_ROWS)}")
        choices.append(PolicyChoice(name, params, params.pop("key_channels", 0.0)))
    if not choices:
        raise UsageError("--policies: give at least one policy")
    return choices


def parse_budgets(text: str, page_size: int) -> list[int]:
    budgets = sorted(set(options.parse_int_list(text, "--budgets", "token counts like 64,128,256")))
    for budget in budgets:
        if budget < page_size or budget % page_size:
            raise UsageError(f"--budgets: {budget} is not a positive multiple of --page-size {page_size}")
        if budget // page_size > MAX_PAGES:
            raise UsageError(f"--budgets: {budget} tokens is more than {MAX_PAGES} pages of --page-size {page_size}")
    return budgets


def parse_dtypes(args: argparse.Namespace) -> list[str]:
    """--dtypes (or --dtype alone), with --equal-memory's dtype first if it is not among them."""
    dtypes = [part.strip() for part in (args.dtypes or args.dtype).split(",") if part.strip()]
    for dtype in [*dtypes, *([args.equal_memory] if args.equal_memory else [])]:
        if dtype not in STORAGE_DTYPES:
            flag = "--equal-memory" if dtype == args.equal_memory and dtype not in dtypes else "--dtypes"
            raise UsageError(f"{flag}: unknown dtype {dtype!r}; the dtypes are {', '.join(STORAGE_DTYPES)}")
    if not dtypes:
        raise UsageError("--dtypes: give at least one dtype")
    if args.equal_memory and args.equal_memory not in dtypes:
        dtypes.insert(0, args.equal_memory)
    return list(dict.fromkeys(dtypes))


def check_budgets(budgets: list[int], args: argparse.Namespace, model_config) -> None:
    """Each budget's cache fits this model's layout and the memory available now (in float32, the
    reference's storage)."""
    from pagevis.kvcache import CacheConfig, ConfigError
    from pagevis.system_memory import available_bytes, fits, gib

    for budget in budgets:
        try:
            config = CacheConfig(page_size=args.page_size, max_pages=budget // args.page_size, dtype="float32",
                                 policy="oldest", n_layers=model_config.n_layers, n_heads=model_config.n_heads,
                                 n_kv_heads=model_config.n_kv_heads, head_dim=model_config.head_dim)
        except ConfigError as error:
            raise UsageError(f"--budgets: {budget} tokens is too large for this model ({error.allowed})") from None
        if not fits(config.total_bytes()):
            raise UsageError(f"--budgets: {budget} tokens needs {gib(config.total_bytes())} of K/V storage with "
                             f"this model, more than the memory available now ({gib(available_bytes() or 0)})")


def load_text(path: str | None) -> str:
    texts = resources.files("pagevis.resources").joinpath("texts")
    if path is None:
        return resources.files("pagevis.resources").joinpath(DEFAULT_TEXT).read_text("utf-8")
    shipped = texts.joinpath(f"{path}.txt")
    if not os.path.exists(path) and "/" not in path and shipped.is_file():
        return shipped.read_text("utf-8")
    return options.read_text_file(path, "TEXTFILE")


def main(args: argparse.Namespace) -> int:
    if not args.no_files:
        options.check_writable(args.csv, "--csv", suffix=".csv")
        options.check_writable(args.plot, "--plot", suffix=".png")
    result, rows, note = measure_rows(args, load_text(args.text) if args.text is not None else None)
    report(result, rows, args, note)
    if not args.quiet:
        print(f"compare: took {_duration(result['seconds'])} (estimated {_duration(result['estimated_seconds'])}), "
              f"peak memory {result['peak_rss_mb']:.0f} MB", file=sys.stderr)
    return 0


def measure_rows(args: argparse.Namespace, text: str | None) -> tuple[dict, list, str | None]:
    """Everything compare measures for these options on `text` (None: the shipped default): the result (the
    JSON object's fields), the rows (the full cache's first) and a note on a hybrid model's full-cache row.
    `pagevis compare` and `pagevis.compare()` both measure here; UsageError for a bad option, before any work."""
    from pagevis.quality import measure
    from pagevis.kvcache import CacheConfig, CacheSettings
    from pagevis.kvcache.memory import modelled_bytes

    options.check_range("--page-size", args.page_size, 1, MAX_PAGE_SIZE)
    options.check_range("--tokens", args.tokens, 2, MAX_TOKENS)
    if args.tmp_dir is not None and not os.path.isdir(args.tmp_dir):
        raise UsageError(f"--tmp-dir {args.tmp_dir}: no such folder")
    choices = parse_policies(args.policies, optimal=not args.no_optimal)
    budgets = parse_budgets(args.budgets, args.page_size)
    dtypes = parse_dtypes(args)
    residual = settings.setting("residual").default if args.residual is None else args.residual
    options.check_range("--residual", residual, 0, settings.MAX_RESIDUAL)
    text = load_text(None) if text is None else text
    spec = options.model_spec(args)
    model = spec.load()
    check_budgets(budgets, args, model.config)
    check_policy_budgets(choices, budgets, args, model.config)
    ids = model.tokenizer.encode(text)[: args.tokens]
    if len(ids) < 2:
        raise UsageError("the text is too short: it must encode to at least 2 tokens")
    plan = configurations(choices, budgets, dtypes, args, residual, model.config, len(ids))
    estimate = measure.estimate_seconds(model, len(ids), [budget for _, budget, _, _ in plan])
    if not args.quiet:
        print(f"compare: {len(ids)} tokens, {len(plan)} configurations; estimated "
              f"{_duration(estimate.total)} (full-cache reference {_duration(estimate.reference)}, from timed "
              f"forward passes), reference files {estimate.disk_bytes / 1e9:.2f} GB", file=sys.stderr)
    work = len(ids) * (1 + len(plan))
    progress = Progress(work, "compare", enabled=False if args.quiet else None)
    done = [0]

    def advance(label):
        base = done[0]
        return lambda n: progress.update(base + n, label)

    log = progress.enabled or args.quiet  # without a progress bar, one line per configuration instead
    # the reference is the full cache at full precision, whatever the rows' storage
    with measure.full_reference(model, ids, page_size=args.page_size, dtype="float32", folder=args.tmp_dir,
                                progress=advance("full cache")) as reference:
        done[0] += len(ids)
        rows = [measure.full_row(reference, args.page_size)]
        rows[0].kv_bytes_per_token = measure.cache_bytes("float32", args.page_size, args.page_size, residual,
                                                         model.config) / args.page_size
        if not log:
            print(f"compare: full cache, ppl {rows[0].ppl:.3f} ({reference.seconds:.0f} s)", file=sys.stderr)
        for choice, budget, dtype, equal in plan:
            label = f"{choice.label} @ {budget} {dtype}" + (f" (= {equal})" if equal else "")
            row = measure.evaluate(model, reference, choice, budget, args.page_size, dtype, residual=residual,
                                   progress=advance(label), equal_memory_to=equal)
            rows.append(row)
            done[0] += len(ids)
            if not log:
                ppl = "-" if row.ppl is None else f"{row.ppl:.3f}"
                print(f"compare: {label}: ppl {ppl} ({row.seconds:.0f} s)", file=sys.stderr)
    progress.close()
    measure.fill_gaps(rows)

    result = {"model": spec.label, "text": args.text or f"pagevis.resources/{DEFAULT_TEXT}", "tokens": len(ids),
              "page_size": args.page_size, "dtypes": dtypes, "reference_dtype": "float32",
              **({"residual": residual} if any(has_residual(d) for d in dtypes) else {}),
              "equal_memory": args.equal_memory, "full_cache_ppl": reference.perplexity(),
              "seconds": progress.elapsed(), "estimated_seconds": estimate.total,
              "peak_rss_mb": measure.peak_rss_bytes() / 1e6, "rows": [row.as_dict() for row in rows[1:]]}
    note = None
    if model.config.local_windows is not None:  # a hybrid model: its full-cache row by layer type
        reference_config = CacheConfig.for_model(CacheSettings(page_size=args.page_size, policy="none"), model.config)
        hybrid = modelled_bytes(reference_config, len(ids))
        labels = sorted({layer_spec.label for layer_spec in reference_config.layer_specs})
        result["hybrid"] = hybrid.as_dict()
        note = f"full-cache row: {hybrid.text()} ({', '.join(labels)} layers)"
    return result, rows, note


def check_policy_budgets(choices, budgets, args, model_config) -> None:
    """Policy parameters that cannot fit a budget fail before decoding (UsageError), not halfway through."""
    from pagevis.quality import measure
    from pagevis.quality.optimal import OPTIMAL
    from pagevis.kvcache import CacheSettings, ConfigError

    for choice in choices:
        for budget in budgets:
            if choice.name == OPTIMAL:
                continue
            try:
                tier = measure.tier_settings(choice, budget, args.page_size, args.tokens)
                for dtype in parse_dtypes(args):
                    CacheSettings(dtype=dtype, key_channels=choice.key_channels, **(tier or {})).check()
                if tier is not None:
                    CacheSettings(page_size=args.page_size, max_pages=budget // args.page_size, **tier).check()
                    continue
                max_pages, params = measure.session_pages(choice, budget, args.page_size, model_config, args.tokens)
                CacheSettings(page_size=args.page_size, max_pages=max_pages, policy=choice.name,
                              policy_params=params).check()
            except ConfigError as error:
                if error.field == "max_pages":  # the budget itself is too large: check_budgets says so
                    continue
                raise UsageError(f"--policies {choice.label} at budget {budget}: {error}") from None


def report(result: dict, rows: list, args: argparse.Namespace, note: str | None = None) -> None:
    """The files (CSV, plot) and the table, or the JSON object, on stdout."""
    if not args.no_files:
        write_csv(args.csv, rows)
        write_plot(args.plot, rows, result)
        result["files"] = {"csv": args.csv, "plot": args.plot}
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return
    storage = ", ".join(result["dtypes"]) + (f" (residual {result['residual']})" if "residual" in result else "")
    print(f"{result['model']}, {result['tokens']} tokens of {result['text']}, page size {args.page_size}, {storage}")
    if note:
        print(note)
    for notice in dict.fromkeys(f"{r.dtype} at {r.budget}: {r.storage_notice}" for r in rows[1:] if r.storage_notice):
        print(notice)
    print(format_table(rows))
    if not args.no_files:
        print(f"wrote {args.csv} and {args.plot}", file=sys.stderr)


def configurations(choices, budgets, dtypes, args, residual, model_config, n_tokens) -> list[tuple]:
    """(policy choice, budget, dtype, equal_memory_to) of every row to evaluate: each dtype x policy x budget,
    then with --equal-memory D each other dtype's largest budget within D's K/V bytes at each budget (no
    larger than the text, a row of its own even when that budget is also among --budgets)."""
    from pagevis.quality import measure

    plan = [(choice, budget, dtype, "") for dtype in dtypes for choice in choices for budget in budgets]
    if args.equal_memory:
        most = -(-n_tokens // args.page_size) * args.page_size
        for budget in budgets:
            allowed = measure.cache_bytes(args.equal_memory, budget, args.page_size, residual, model_config)
            for dtype in dtypes:
                if dtype == args.equal_memory:
                    continue
                fits = measure.equal_memory_budget(dtype, allowed, args.page_size, residual, model_config, most)
                if fits:
                    plan += [(choice, fits, dtype, f"{args.equal_memory}@{budget}") for choice in choices]
    return plan


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def format_table(rows) -> str:
    dtypes = (len({r.dtype for r in rows[1:]}) > 1 or any(r.dtype != "float32" for r in rows[1:])
              or any(r.key_channels for r in rows[1:]))
    storage = f"{'dtype':<7} {'KiB/tok':>7} " if dtypes else ""
    header = (f"{'policy':<18} {storage}{'budget':>6} {'ppl':>8} {'ppl evict':>9} {'full':>8} {'vs opt':>7} "
              f"{'mean KL':>8} {'top-1':>6} {'lost attn':>9} {'evictions':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        memory = (f"{r.dtype:<7} {_f(None if r.kv_bytes_per_token is None else r.kv_bytes_per_token / 1024, 7, 2)} "
                  if dtypes else "")
        if r.ppl is None:
            lines.append(f"{r.policy:<18} {memory}{r.budget:>6}  {r.note}")
            continue
        lines.append(f"{r.policy:<18} {memory}{r.budget:>6} {_f(r.ppl, 8, 3)} {_f(r.ppl_evicting, 9, 3)} "
                     f"{_f(r.full_ppl_evicting, 8, 3)} {_gap(r.gap_to_optimal)} {_f(r.mean_kl, 8, 4)} "
                     f"{_f(r.top1_agreement, 6, 3)} "
                     f"{_f(r.lost_attention, 9, 4)} {r.evictions:>9}"
                     + ("" if r.recall is None else f"  recall {r.recall:.3f}")
                     + ("" if r.mean_resident is None or r.recall is not None or r.mean_resident >= r.budget - 0.5
                        else f"  holds {r.mean_resident:.1f} ({r.kv_bytes_held / 1e6:.2f} MB)")
                     + (f"  = {r.equal_memory_to} bytes" if r.equal_memory_to else ""))
    lines.append("ppl: all predicted tokens. ppl evict / full, mean KL, top-1, lost attn: the tokens predicted "
                 "once the cache was full (bounded vs full cache on the same tokens). vs opt: ppl evict over "
                 "optimal's at the same budget, minus 1. quest / disk: RAM frames = budget, the rest on disk; "
                 "lost attn is then the attention on tokens not read, recall = 1 - lost attn."
                 + (" kvzip: its context (the text's first n - budget tokens) is prefilled whole and compressed to "
                    "the budget; ppl evict, full and vs opt are over the tokens after it (optimal's on the same "
                    "tokens): its row's note says where." if any(r.scored_from is not None for r in rows) else "")
                 + (" KiB/tok: K/V bytes per token at the budget, all layers (pages, scales, zero points and the "
                    "residual window); = D@B: the largest budget within dtype D's K/V bytes at budget B. Quality "
                    "is against the float32 full cache." if dtypes else ""))
    return "\n".join(lines)


def _gap(value) -> str:
    if value is None:
        return f"{'-':>7}"
    return f"{value:>+7.0%}" if abs(value) >= 10 else f"{value:>+7.1%}"


def _f(value, width, digits) -> str:
    if value is None:
        return f"{'-':>{width}}"
    text = f"{value:.{digits}f}"
    return f"{text if len(text) <= width else f'{value:.{max(width - 6, 1)}g}':>{width}}"


def write_csv(path: str, rows) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if value is None else value for key, value in row.as_dict().items()})


def write_plot(path: str, rows, result) -> None:
    from pagevis.plots import line_plot

    series, layout = plot_series(rows, result)
    line_plot(path, series, **layout)


def plot_series(rows, result) -> tuple[dict, dict]:
    """The plot of perplexity vs budget (vs K/V memory across dtypes): its series (label -> xs, ys, sorted by x;
    the full cache's dashed) and its layout (line_plot's title, labels, log axes, dashed series and ticks). The
    PNG here and a notebook's inline SVG (pagevis.notebook.plot) draw the same plot from them."""
    import numpy as np

    series: dict[str, tuple[list, list]] = {}
    by_memory = len(result["dtypes"]) > 1
    for row in sorted(rows[1:], key=lambda r: (r.dtype, r.policy, r.budget)):
        if row.ppl is None:
            continue
        xs, ys = series.setdefault(f"{row.policy} {row.dtype}" if by_memory else row.policy, ([], []))
        xs.append(row.kv_bytes / 1e6 if by_memory else row.budget)
        ys.append(row.ppl)
    for xs, ys in series.values():
        order = np.argsort(xs, kind="stable")
        xs[:], ys[:] = [xs[i] for i in order], [ys[i] for i in order]
    budgets = sorted({x for xs, _ in series.values() for x in xs})
    series["full cache"] = (budgets, [result["full_cache_ppl"]] * len(budgets))
    values = [y for _, ys in series.values() for y in ys if y]
    ladder = (10, 12, 14, 16, 18, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
    ticks = [t for t in ladder if min(values, default=1) / 1.1 <= t <= max(values, default=1) * 1.1]
    return series, dict(
        title=f"Perplexity vs {'K/V memory' if by_memory else 'cache budget'} ({result['model']}, "
              f"{result['tokens']} tokens, page size {result['page_size']})",
        x_label="K/V memory of the bounded cache, all layers (MB)" if by_memory else "cache budget (tokens per layer)",
        y_label="perplexity (log scale)", log_x=True, log_y=True, dashed={"full cache", "optimal"},
        x_ticks=None if by_memory else budgets, y_ticks=ticks or None)

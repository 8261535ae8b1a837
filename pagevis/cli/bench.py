"""`pagevis bench`: the engine's speed in one run, as ratios; tables on stdout, CSVs and PNG plots."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from pagevis.cli import bench_targets, options
from pagevis.cli.options import UsageError

FULL_CONTEXTS = "32,128,512,1024,2048,4096,8192"
QUICK_CONTEXTS = "32,128,512"
MAX_DECODE_TOKENS = bench_targets.MAX_DECODE_TOKENS
# Peak memory of the attention rows per context token (float64 draws, K/V, the page pool and the dense copy),
# measured at 4.7 KB with SmolLM2's layer shape at 64k and 256k tokens; rounded up for torch's copies.
BYTES_PER_CONTEXT_TOKEN = 8 << 10


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "bench", help="paged vs dense attention, float16 vs float32, torch, decode speed vs bandwidth floor",
        description="Benchmark the engine in one run: paged vs dense NumPy decode attention over context lengths "
                    "and page sizes (SmolLM2's layer shape: 9 query heads, 3 KV heads, head dim 64); float16 vs "
                    "float32 storage; torch's scaled_dot_product_attention on the same data when torch is "
                    "installed; and the model's decode tokens/s against the memory-bandwidth floor (read "
                    "bandwidth of a weight-sized float32 gemv or sum, on the BLAS threads decoding uses, over "
                    "weight bytes per token). "
                    "Timings are medians; a busy machine makes them noisy.")
    parser.add_argument("--contexts", metavar="LIST", help=f"context lengths (default {FULL_CONTEXTS})")
    parser.add_argument("--page-sizes", metavar="LIST", help="page sizes (default 8,16,32,64)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a fast, rough run: contexts {QUICK_CONTEXTS}, page size 16, few repeats, the "
                             "synthetic model")
    options.add_model_options(parser)
    parser.add_argument("--no-model", action="store_true", help="skip the model decode benchmark")
    parser.add_argument("--no-sequences", action="store_true",
                        help="skip the many-sequences rows (aggregate tokens/s at 1-16 sequences, parallel "
                             "sampling pages, shared-prompt prefix-cache hit rate)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the model-side kernel rows (decode of 1-16 sequences through one batched forward, "
                             "decode attention at 8,192 tokens against the read bandwidth and torch, prefill of 1 "
                             "and 8 scored 512-token prompts against sgemm)")
    parser.add_argument("--no-tiers", action="store_true",
                        help="skip the disk-tier rows (exact streamed attention vs RAM share, quest vs K, RssAnon "
                             "from 4k to 32k tokens; see docs/memory.md)")
    parser.add_argument("--swap-dir", metavar="DIR", help="disk-tier rows: where the swap files go")
    parser.add_argument("--decode-tokens", type=int, default=32, metavar="N", help="decode steps to time (32)")
    parser.add_argument("--out", default=".", metavar="DIR",
                        help="folder for bench-*.csv and bench-latency.png, bench-memory.png (default .)")
    parser.add_argument("--no-files", action="store_true", help="write no CSV or PNG")
    parser.add_argument("--remeasure-plans", action="store_true",
                        help="measure the model's matmul plans again first (a plan measured while the machine was "
                             "busy is measured again by itself once the machine is quiet)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every table")
    parser.add_argument("--transformers-python", metavar="PYTHON",
                        help="a Python with torch, transformers, accelerate and gguf: time transformers eager "
                             "decoding of the same GGUF with it (default: this Python, if it has them)")
    parser.set_defaults(handler=main, target=None)
    bench_targets.add_parsers(parser)
    return parser


def max_context() -> int:
    """The longest context whose attention rows fit in half the memory available now (at most 2**20)."""
    from pagevis.system_memory import available_bytes

    available = available_bytes()
    return 1 << 20 if available is None else max(1024, min(1 << 20, available // 2 // BYTES_PER_CONTEXT_TOKEN))


def parse_ints(text: str, flag: str, low: int, high: int) -> list[int]:
    values = options.parse_int_list(text, flag, "numbers like 32,128,512")
    if any(not low <= v <= high for v in values):
        raise UsageError(f"{flag} {text!r}: each must be from {low} to {high}")
    return values


class _Sections:
    """The bench's measurements one after another: each said on stderr as it starts, and the load average when
    it ended kept for its table's heading."""

    def __init__(self, say):
        self.say, self.loads = say, {}

    def run(self, name: str, message: str, measure):
        from pagevis.bench.machine import load_average

        self.say(message)
        value = measure()
        self.loads[name] = load_average()
        return value


def main(args: argparse.Namespace) -> int:
    from pagevis.bench import machine, suite

    contexts = parse_ints(args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS), "--contexts", 1,
                          max_context())
    page_sizes = parse_ints(args.page_sizes or ("16" if args.quick else "8,16,32,64"), "--page-sizes", 1, 4096)
    options.check_range("--decode-tokens", args.decode_tokens, 1, MAX_DECODE_TOKENS)
    if args.transformers_python and not os.access(args.transformers_python, os.X_OK):
        raise UsageError(f"--transformers-python {args.transformers_python}: not an executable")
    if not args.no_files:
        if not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out}: no such folder")
        options.check_writable(os.path.join(args.out, "bench-latency.png"), "--out")
    spec = None
    if not args.no_model:
        if args.quick and args.model is None:
            args.model = "synthetic"
        spec = options.model_spec(args)
    say = (lambda text: print(text, file=sys.stderr)) if not args.json else (lambda text: None)
    host = machine.describe()
    say(machine.machine_line(host))
    if args.remeasure_plans and spec is not None and spec.kind != "synthetic":
        from pagevis.model.matmul import plan_for

        say("matmul plans: measuring again ...")
        plan_for(spec.load().weights.matrices(), remeasure=True)
    sections = _Sections(say)
    result, half = _attention_tables(args, contexts, page_sizes, sections)
    result.update(_model_tables(args, spec, sections) if spec is not None else
                  {"decode": None, "kernels": None, "prefill": None, "sequences": None})
    result["tiers"] = None if args.no_tiers else _tier_tables(args, contexts, sections)
    result.update(shape=suite.SMOLLM2_LAYER, machine=host, loads=sections.loads)
    if not args.no_files:
        result["files"] = write_files(args.out, result, half)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_report(result))
    return 0


def _attention_tables(args, contexts, page_sizes, sections: _Sections) -> tuple[dict, list]:
    """Decode attention over one layer: paged vs dense, float16 and quantized storage, a hybrid cache, torch."""
    from pagevis.bench import attention, suite
    from pagevis.bench.hybrid import hybrid_rows

    repeats = 10 if args.quick else None
    page = 16 if 16 in page_sizes else page_sizes[0]
    paged = sections.run("attention", "attention: paged vs dense, float32 ...",
                         lambda: attention.run_attention_bench(contexts, page_sizes, dtype="float32", repeats=repeats))
    half = sections.run("storage", "attention: float16 storage ...",
                        lambda: attention.run_attention_bench(contexts, [page], dtype="float16", repeats=repeats))
    quantized = sections.run("quantized", "attention: quantized storage (int8, int4, int2) ...",
                             lambda: suite.quantized_rows(contexts, page, repeats=repeats))
    hybrid = sections.run("hybrid", "attention: a hybrid cache (Gemma 3 270M's sliding-window and global layers) ...",
                          lambda: hybrid_rows(contexts, page, repeats=repeats))
    torch_rows = None
    if suite.torch_available():
        torch_rows = sections.run("torch", "attention: torch scaled_dot_product_attention ...",
                                  lambda: suite.torch_rows(contexts, page, repeats=repeats, threads=args.blas_threads))
    return {"attention": paged, "storage": suite.storage_rows(paged, half), "quantized": quantized, "hybrid": hybrid,
            "torch": torch_rows}, half


def _model_tables(args, spec, sections: _Sections) -> dict:
    """The model: one sequence against the read floor (and transformers), the batched kernels, prefill, many
    sequences."""
    from pagevis.bench import suite

    def decode() -> dict:
        row = suite.decode_row(spec, n_tokens=args.decode_tokens, probe_bytes=(64 << 20) if args.quick else None)
        eager = suite.transformers_row(spec, args.transformers_python, args.decode_tokens, args.blas_threads)
        if eager:
            row.update(transformers_tok_s=eager["tokens_per_s"], transformers_threads=eager["threads"],
                       transformers_versions=eager["versions"],
                       paged_over_transformers=row["paged_tok_s"] / eager["tokens_per_s"])
        return row

    tables = {"decode": sections.run("decode", f"decode: {spec.label} (and transformers eager, if available) ...",
                                     decode), "kernels": None, "prefill": None, "sequences": None}
    if not args.no_kernels:
        from pagevis.bench.kernels import run_kernel_bench
        from pagevis.bench.prefill import CONCURRENT, PROMPT_TOKENS, run_prefill_bench

        tables["kernels"] = sections.run(
            "kernels", "kernels: batched decode through the forward, decode attention against the read bandwidth ...",
            lambda: run_kernel_bench(spec.load(), quick=args.quick, threads=args.blas_threads))
        tables["prefill"] = sections.run(
            "prefill", "prefill: scored prompts (log-likelihood requests) one and many at once, against sgemm ...",
            lambda: run_prefill_bench(spec.load(), (1, 2) if args.quick else CONCURRENT,
                                      64 if args.quick else PROMPT_TOKENS))
    if not args.no_sequences:
        from pagevis.bench.sequences import run_sequences_bench

        tables["sequences"] = sections.run(
            "sequences", "many sequences: continuous batching, parallel sampling, prefix caching ...",
            lambda: run_sequences_bench(spec.load(), spec.kind, n_tokens=4 if args.quick else 12))
    return tables


def _tier_tables(args, contexts, sections: _Sections) -> dict:
    from pagevis.bench import tiers as tier_bench

    repeats = 10 if args.quick else None
    tier_contexts = [c for c in contexts if c >= 512] or [max(contexts)]
    return sections.run("tiers", "disk tier: streamed attention by RAM share, quest by K, memory by context ...",
                        lambda: {"streamed": tier_bench.streamed_rows(tier_contexts, swap_dir=args.swap_dir,
                                                                      repeats=repeats),
                                 "quest": tier_bench.quest_rows(max(tier_contexts), swap_dir=args.swap_dir),
                                 "rss": None if args.quick else tier_bench.rss_rows(swap_dir=args.swap_dir)})


def format_report(result: dict) -> str:
    from pagevis.bench.machine import machine_line

    loads = result.get("loads")
    out = [machine_line(result["machine"]), ""] if result.get("machine") else []
    out += _attention_report(result, loads)
    if result["decode"]:
        out += _decode_report(result["decode"], loads)
    if result.get("kernels"):
        from pagevis.bench.kernels import format_kernels

        out += _titled(format_kernels(result["kernels"]), loads, "kernels")
    if result.get("prefill"):
        from pagevis.bench.prefill import format_prefill

        out += _titled(format_prefill(result["prefill"]), loads, "prefill")
    if result.get("sequences"):
        from pagevis.bench.sequences import format_sequences

        out += _titled(format_sequences(result["sequences"]), loads, "sequences")
    if result.get("tiers"):
        from pagevis.bench.tiers import format_tables

        t = result["tiers"]
        out += _titled(format_tables(t["streamed"], t["quest"], t["rss"]), loads, "tiers")
    if result.get("files"):
        out += ["", "wrote " + ", ".join(result["files"])]
    return "\n".join(out)


def _titled(lines: list[str], loads, section: str) -> list[str]:
    """A table after a blank line, its first line (the title) with the load while it was measured."""
    from pagevis.bench.machine import load_note

    return ["", lines[0] + load_note(loads, section), *lines[1:]]


def _table(rows: list[dict], *columns: tuple[str, int, str]) -> list[str]:
    """A fixed-width table's lines: the headings, then a line a row. A column is (heading, width, the cell: a
    format string over the row's keys); headings and cells are right-aligned to the width."""
    return [" ".join(f"{heading:>{width}}" for heading, width, _ in columns),
            *(" ".join(f"{cell.format(**row):>{width}}" for _, width, cell in columns) for row in rows)]


def _attention_report(result: dict, loads) -> list[str]:
    from pagevis.bench.attention import format_table
    from pagevis.bench.machine import load_note

    out = ["Paged vs dense decode attention (one layer, 9 query / 3 KV heads, head dim 64, float32)"
           + load_note(loads, "attention"),
           format_table(result["attention"]), "", "Storage: float16 vs float32 (paged)" + load_note(loads, "storage"),
           *_table([{**r, "f32_kib": r["f32_kv_bytes"] / 1024, "f16_kib": r["f16_kv_bytes"] / 1024}
                    for r in result["storage"]], ("context", 8, "{context}"), ("page", 5, "{page_size}"),
                   ("f32 µs", 9, "{f32_us:.1f}"), ("f16 µs", 9, "{f16_us:.1f}"), ("f16/f32", 8, "{f16_over_f32:.2f}x"),
                   ("f32 KV KiB", 11, "{f32_kib:.0f}"), ("f16 KV KiB", 11, "{f16_kib:.0f}")), ""]
    if result.get("quantized"):
        out += ["Quantized storage (paged, one layer; output error against float32 storage; KV bytes per token: "
                "pages, scales, zero points, key groups and int4 / int2's float32 window; docs/quantization.md)"
                + load_note(loads, "quantized"),
                *_table([{**r, "kv_kib": r["kv_bytes"] / 1024} for r in result["quantized"]],
                        ("context", 8, "{context}"), ("dtype", 8, "{dtype}"), ("µs", 9, "{paged_us:.1f}"),
                        ("vs f32", 7, "{over_first:.2f}x"), ("B/token", 9, "{kv_bytes_per_token:.1f}"),
                        ("KV KiB", 8, "{kv_kib:.1f}"), ("rel error", 10, "{rel_error:.2e}")), ""]
    if result.get("hybrid"):
        from pagevis.bench.hybrid import format_rows

        hybrid_lines = format_rows(result["hybrid"])
        out += [hybrid_lines[0] + load_note(loads, "hybrid"), *hybrid_lines[1:], ""]
    if result["torch"]:
        first = result["torch"][0]
        out.append(f"torch {first['torch_version']} scaled_dot_product_attention on the same data "
                   f"({first['torch_threads']} threads, as many as our BLAS threads; GQA read in place)"
                   + load_note(loads, "torch"))
        out.append(f"{'context':>8} {'dtype':>8} {'KV KiB':>8} {'paged µs':>9} {'dense µs':>9} {'torch µs':>9} "
                   f"{'paged/torch':>12}")
        for r in result["torch"]:
            if r["torch_us"] is None:
                out.append(f"{r['context']:>8} {r['dtype']:>8}  torch: {r['note']}")
                continue
            out.append(f"{r['context']:>8} {r['dtype']:>8} {r['kv_bytes'] / 1024:>8.0f} {r['paged_us']:>9.1f} "
                       f"{r['dense_us']:>9.1f} {r['torch_us']:>9.1f} {r['paged_over_torch']:>11.2f}x")
    else:
        out.append("torch: not installed (make torch, or pip install -e '.[torch]', to compare with "
                   "scaled_dot_product_attention)")
    out.append("")
    return out


def _decode_report(d: dict, loads) -> list[str]:
    from pagevis.bench.machine import load_note

    out = [f"Decode speed: {d['model']}" + load_note(loads, "decode"),
            f"  weights read per token {d['weight_mb_per_token']:.1f} MB",
            f"  read bandwidth {d['read_gb_s']:.2f} GB/s (best of a {d['probe_mb']:.0f} MB float32 gemv, "
            f"{d['gemv_gb_s']:.2f}, and a sum, {d['reduce_gb_s']:.2f}, on decoding's threads)",
            f"  bandwidth floor {d['floor_tok_s']:.1f} tok/s (read bandwidth / weight bytes)",
            f"  paged session   {d['paged_tok_s']:.1f} tok/s ({d['paged_of_floor']:.2f} of the floor; median of "
            f"{d['decode_steps']} steps)",
            f"  dense attention {d['dense_tok_s']:.1f} tok/s ({d['dense_of_floor']:.2f} of the floor)",
            f"  (copy: {d['copy_gb_s']:.2f} GB/s counting each byte once, {d['copy_tok_s']:.1f} tok/s; a copy "
            f"reads and writes every byte, so this is not a floor)"]
    out += [f"  WARNING: {w}" for w in d["warnings"]]
    if d.get("shapes"):
        out.append("  read rate by weight shape, one row (the forward's kernel / a contiguous gemv of the same "
                   "bytes):")
        out += [f"    {r['shape']:>12} x{r['matrices']:<3} {r['mb']:>7.1f} MB  {r['kernel']:>6} "
                f"{r['forward_gb_s']:>6.2f} GB/s" + (f"  gemv {r['gemv_gb_s']:>6.2f} GB/s" if r["gemv_gb_s"] else "")
                for r in d["shapes"]]
    if "transformers_tok_s" in d:
        out.append(f"  transformers eager {d['transformers_tok_s']:.1f} tok/s ({d['transformers_threads']} torch "
                   f"threads, as many as our BLAS threads); paged session {d['paged_over_transformers']:.2f}x "
                   f"transformers")
    else:
        out.append("  transformers eager: not measured (--transformers-python PYTHON)")
    return out


def write_files(folder: str, result: dict, half: list[dict]) -> list[str]:
    from pagevis.plots import line_plot

    written = []
    for name in ("attention", "storage", "quantized", "hybrid", "torch"):
        rows = result.get(name)
        if rows:
            path = os.path.join(folder, f"bench-{name}.csv")
            with open(path, "w", newline="", encoding="utf-8") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
            written.append(path)
    if result["decode"]:
        path = os.path.join(folder, "bench-decode.csv")
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(result["decode"]))
            writer.writeheader()
            writer.writerow({**result["decode"], "warnings": "; ".join(result["decode"]["warnings"])})
        written.append(path)

    rows = result["attention"]
    contexts = sorted({r["context"] for r in rows})
    series = {"dense NumPy": _by_context(rows, "dense_us", page_size=rows[0]["page_size"])}
    for page_size in sorted({r["page_size"] for r in rows}):
        series[f"paged, page {page_size}"] = _by_context(rows, "paged_us", page_size=page_size)
    series[f"paged float16, page {half[0]['page_size']}"] = _by_context(half, "paged_us")
    torch_measured = [r for r in result["torch"] or () if r["torch_us"] is not None]
    for dtype in ("float32", "float16"):
        chosen = [r for r in torch_measured if r["dtype"] == dtype]
        if chosen:
            series[f"torch SDPA {dtype}"] = _by_context(chosen, "torch_us")
    path = os.path.join(folder, "bench-latency.png")
    line_plot(path, series, "Decode attention latency vs context (one layer, 9q/3kv heads, d 64)",
              "context (tokens)", "latency (µs)", log_x=True, log_y=True, x_ticks=contexts,
              y_ticks=_decades(v for _, ys in series.values() for v in ys),
              dashed={"dense NumPy", "torch SDPA float32", "torch SDPA float16"})
    written.append(path)

    memory = {}
    for r in result["storage"]:
        for dtype, key, size in (("float32", "f32_us", "f32_kv_bytes"), ("float16", "f16_us", "f16_kv_bytes")):
            xs, ys = memory.setdefault(f"paged {dtype}, page {r['page_size']}", ([], []))
            xs.append(r[size] / 1024)
            ys.append(r[key])
    for r in result.get("hybrid") or ():  # one layer of each kind: a local layer's bytes stop at its window
        for kind, count in (("local", r["local_layers"]), ("global", r["global_layers"])):
            xs, ys = memory.setdefault(f"Gemma 3 {kind} layer ({r['dtype']}, d 256)", ([], []))
            xs.append(r[f"kv_bytes_{kind}"] / count / 1024)
            ys.append(r[f"{kind}_us"])
    for r in torch_measured:
        xs, ys = memory.setdefault(f"torch SDPA {r['dtype']}", ([], []))
        xs.append(r["kv_bytes"] / 1024)
        ys.append(r["torch_us"])
    path = os.path.join(folder, "bench-memory.png")
    line_plot(path, memory, "KV memory vs attention latency per layer (points: contexts)", "K+V memory (KiB)",
              "latency (µs)", log_x=True, log_y=True, x_ticks=_decades(x for xs, _ in memory.values() for x in xs),
              y_ticks=_decades(v for _, ys in memory.values() for v in ys),
              dashed={"torch SDPA float32", "torch SDPA float16"})
    written.append(path)
    if result.get("tiers"):
        from pagevis.bench.tiers import write_plots

        written += write_plots(folder, result["tiers"]["streamed"], result["tiers"]["quest"], line_plot)
    return written


def _decades(values) -> list[float]:
    """1-2-5 steps covering the values, for a readable log axis."""
    values = [v for v in values if v and v > 0]
    if not values:
        return []
    low, high = min(values), max(values)
    ticks, decade = [], 10 ** math.floor(math.log10(low))
    while decade <= high * 10:
        ticks += [m * decade for m in (1, 2, 5) if low / 2 <= m * decade <= high * 2]
        decade *= 10
    return ticks


def _by_context(rows, key, page_size=None):
    chosen = [r for r in rows if page_size is None or r["page_size"] == page_size]
    chosen.sort(key=lambda r: r["context"])
    return [r["context"] for r in chosen], [r[key] for r in chosen]

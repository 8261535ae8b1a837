"""`pagevis run`: decode headless with the app's options; text (or one JSON object) on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np

from pagevis.presets import default_prompt
from pagevis.cli import options
from pagevis.cli.metrics_port import add_metrics_option, start_metrics_server
from pagevis.cli.checks import check_cache_memory, check_prompt_fits
from pagevis.cli.parallel import add_parallel_options, check_parallel_options, run_parallel
from pagevis.cli.progress import Progress
from pagevis.cli import teacher_forced


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "run", help="decode headless and print the text (or --json)",
        description="Decode a prompt headless with the same options as the app. The generated text goes to "
                    "stdout (or one JSON object with --json); a progress bar goes to stderr.")
    options.add_session_options(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the text and the metrics; its rates are wall clock, with "
                             "everything the run waits for inside (the record, the oracle): tokens_per_s from the "
                             "first decoded token to the last, prefill_tokens_per_s the prompt over the time to the "
                             "first token")
    parser.add_argument("--trace", metavar="FILE", help="record the run to a trace file (open it with pagevis replay)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_metrics_option(parser)
    add_parallel_options(parser)
    teacher_forced.add_options(parser)
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from pagevis.engine import DecodeSession
    from pagevis.kvcache import CacheFullError
    from pagevis.kvcache.swap import SwapSpaceError

    if args.teacher_forced:
        return teacher_forced.main(args)
    if args.tokens is not None:
        raise options.UsageError("--tokens only applies with --teacher-forced")
    spec = options.model_spec(args)
    config = options.session_config(args)
    if not args.trace and args.record_layers is None:  # nothing reads the records' attention: the step skips it
        config = replace(config, record_layers=())
    prompt = options.prompt_text(args) or default_prompt(spec.kind)
    check_parallel_options(args)
    if args.n > 1:
        return run_parallel(args, spec, config, prompt)
    if args.trace:
        options.check_writable(args.trace, "--trace")
    metrics, exporter = start_metrics_server(args.metrics_port)
    model = spec.load()
    check_cache_memory(config, model.config)
    session = DecodeSession(model, prompt, config)
    check_prompt_fits(config, session.prompt_ids, model.config)
    session.record_cache = bool(args.trace)  # what run prints reads none of the cache's grids
    progress = Progress(config.max_new_tokens, "decoding", enabled=False if args.quiet else None)
    session.add_hook(lambda record: progress.update(
        len(session.generated), f"{record.kind} step {record.step}, {record.resident_tokens} resident"))
    if metrics is not None:
        metrics.observe(session)
    stamps: list[float] = []  # when each step's record was made (after every hook): the user's clock
    session.add_hook(lambda record: stamps.append(time.perf_counter()))
    started = time.perf_counter()
    interrupted = False
    try:
        for _record in session.run():
            pass
    except CacheFullError as error:  # the engine ended the request ("cache_full")
        print(f"pagevis run: stopped: {error}", file=sys.stderr)
    except SwapSpaceError as error:  # raised before the step changed anything: the steps so far are kept
        print(f"pagevis run: stopped: {error.strerror}", file=sys.stderr)
    except KeyboardInterrupt:
        session.engine.cancel(session.seq_id, "interrupted")
        interrupted = True
    finally:
        progress.close()
        session.close()
        if exporter is not None:
            exporter.shutdown()
            exporter.server_close()
    elapsed = time.perf_counter() - started
    if args.trace and not session.records:
        print(f"pagevis run: no step completed, so no trace was written to {args.trace}", file=sys.stderr)
    elif args.trace:
        from pagevis.trace import write_trace

        size = write_trace(args.trace, session, model_spec=spec, meta={"command": "pagevis run"})
        if not args.quiet:
            print(f"trace: {args.trace} ({size / 1024:.0f} KiB, {len(session.records)} steps)", file=sys.stderr)
    summary = summarize(session, spec.label, elapsed, started, stamps)
    summary["weights"] = getattr(model, "weight_info", None)
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(summary["text"])
    return 130 if interrupted else 0


def summarize(session, model_label: str, elapsed: float, started: float, stamps: list[float]) -> dict:
    """The run's numbers. One clock, the wall's, with everything the user waits for inside (the oracle, the record,
    kvzip's reconstruction pass): tokens_per_s from the first decoded token to the last (the tokens after the first
    over that time), prefill_tokens_per_s the prompt's tokens over the time from the start to the first token.
    stamps: when each record was made."""

    records = session.records
    config = session.config
    first = next((i for i, r in enumerate(records) if r.next_token >= 0), None)  # the step that decoded a token first
    decoded = len(records) - 1 - first if first is not None else 0
    decode_seconds = stamps[-1] - stamps[first] if decoded else 0.0
    prefill_seconds = stamps[first] - started if first is not None else 0.0
    summary = {
        "model": model_label,
        "prompt_tokens": len(session.prompt_ids),
        "generated_tokens": len(session.generated),
        "text": session.text(),
        "stop_reason": session.stop_reason,
        "page_size": config.page_size,
        "max_pages": config.max_pages,
        "capacity": config.capacity,
        **session.cache.storage(),
        "policy": config.policy,
        "policy_params": _policy_params(session),
        "steps": len(records),
        "evictions": records[-1].evictions_total if records else 0,
        "peak_resident_tokens": max((r.resident_tokens for r in records), default=0),  # layer 0's
        # per kind of layer (Gemma 3: its sliding-window layers apart from its global ones), the most tokens one of
        # its layers holds at the end
        "resident_tokens_by_layers": {label: max(held) for label, held in
                                      session.cache.resident_by_layers(session.seq_id).items()},
        "tokens_per_s": decoded / decode_seconds if decode_seconds > 0 else None,
        "prefill_tokens_per_s": len(session.prompt_ids) / prefill_seconds if prefill_seconds > 0 else None,
        "seconds": elapsed,
    }
    if session.policy.compresses:
        summary["compression"] = compression_summary(session)
    scored = [r.oracle for r in records if r.oracle is not None and r.next_token >= 0]
    if config.oracle:
        summary.update(
            mean_kl=float(np.mean([o.kl for o in scored])) if scored else None,
            top1_agreement=float(np.mean([o.top1_agree for o in scored])) if scored else None,
            mean_lost_attention=float(np.mean([o.lost_attention for o in scored])) if scored else None,
            oracle_steps=len(scored),
        )
    if any(r.tiers is not None for r in records):
        summary.update(disk_pages=config.disk_pages, select=config.select, select_pages=config.select_pages,
                       tiers=tier_summary(records, session.cache_config.page_bytes()))
    return summary


def compression_summary(session) -> dict:
    """A compressing policy (kvzip): its reconstruction pass, each (layer, KV head)'s budget, and the K/V held
    at the end as entries (what a per-head layout stores) and as slots (what the shared pages hold)."""
    policy, cache, cfg = session.policy, session.cache, session.cache_config
    from pagevis.kvcache import EventKind

    reconstruct = [r.timings["reconstruct"] for r in session.records if "reconstruct" in r.timings]
    fed = [e.detail for r in session.records for e in r.events if e.kind is EventKind.RECONSTRUCT]
    entry_bytes = 2 * cfg.head_dim * np.dtype(cfg.dtype).itemsize  # one KV head's key and value of one token
    layers = range(cfg.n_layers)
    return {
        "compressed": policy.compressed,
        "context_tokens": policy.context_length,
        "reconstruct_tokens": fed[0] if fed else None,
        "reconstruct_seconds": reconstruct[0] if reconstruct else None,
        "head_budgets": None if policy.head_budgets is None else policy.head_budgets.tolist(),
        "kv_bytes_entries": sum(cache.head_entries(session.seq_id, layer) for layer in layers) * entry_bytes,
        "kv_bytes_slots": sum(cache.resident(session.seq_id, layer) for layer in layers) * cfg.n_kv_heads
        * entry_bytes,
    }


def tier_summary(records, page_bytes: int) -> dict:
    """Disk tier and page selection: totals, per-step means, and every step's counts per layer."""
    from pagevis.kvcache import COUNT_NAMES

    stepped = [r for r in records if r.tiers is not None]
    counts = np.stack([r.tiers.counts for r in stepped])  # (steps, layers, columns)
    total = {name: int(counts[..., i].sum()) for i, name in enumerate(COUNT_NAMES)}
    read = total["hits"] + total["faults"]
    recall = [r.tiers.recall for r in stepped if r.tiers.recall is not None and r.kind == "decode"]
    return {
        **total,
        "page_bytes": page_bytes,
        "hit_rate": total["hits"] / read if read else None,
        "faults_per_step": total["faults"] / len(stepped),
        "mb_read_per_step": total["bytes_read"] / len(stepped) / 1e6,
        "mb_written_per_step": total["bytes_written"] / len(stepped) / 1e6,
        "mean_recall": float(np.nanmean(recall)) if recall else None,
        "per_step": [{"step": r.step, **{name: r.tiers.counts[:, i].tolist() for i, name in enumerate(COUNT_NAMES)},
                      "recall": None if r.tiers.recall is None else [round(float(x), 6) for x in r.tiers.recall]}
                     for r in stepped],
    }


def _policy_params(session) -> dict:
    """The policy's parameters as bound (defaults filled in, e.g. h2o's recent window)."""
    from pagevis.kvcache.policies import bound_params

    return bound_params(session.policy)

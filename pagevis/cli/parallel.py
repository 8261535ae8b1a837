"""`pagevis run --n N`: N samples of one prompt over one shared pool (the prompt's pages shared, the
partial last page copied on write), decoded with continuous batching."""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagevis import settings
from pagevis.cli import options


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("many sequences")
    group.add_argument("--n", type=int, default=1, metavar="N",
                       help="sample N continuations of the prompt (seeds --seed .. --seed+N-1) sharing the "
                            "prompt's pages; implies --sample (default 1)")
    settings.add_flags(group, "batch", front_end="run")  # --pool-pages, --int8-rows


def check_parallel_options(args: argparse.Namespace) -> None:
    from pagevis.settings import MAX_SEQUENCES

    if not 1 <= args.n <= MAX_SEQUENCES:
        raise options.UsageError(f"--n {args.n}: must be an integer from 1 to {MAX_SEQUENCES}")
    for flag, given in (("--pool-pages", args.pool_pages is not None), ("--int8-rows", args.int8_rows is not None)):
        if args.n == 1 and given:
            raise options.UsageError(f"{flag} only applies with --n 2 or more")
    if args.n > 1 and (args.trace or args.oracle or args.metrics_port is not None):
        flag = "--trace" if args.trace else "--oracle" if args.oracle else "--metrics-port"
        raise options.UsageError(f"{flag} follows a single session; it cannot be combined with --n {args.n}")


def run_parallel(args: argparse.Namespace, spec, config, prompt: str) -> int:
    from dataclasses import replace

    from pagevis.engine import Engine, run
    from pagevis.engine.batch import BatchConfig
    from pagevis.engine.batch_summary import batch_summary
    from pagevis.kvcache import CacheFullError, ConfigError
    from pagevis.kvcache.swap import SwapSpaceError
    from pagevis.cli.checks import check_prompt_fits

    if config.sampling.mode == "greedy":  # N greedy continuations of one prompt would be one text N times
        config = replace(config, sampling=replace(config.sampling, mode="sample"))
    try:
        batch_config = BatchConfig(pool_pages=args.pool_pages, max_seqs=max(args.n, 1),
                                   **({} if args.int8_rows is None else {"int8_rows": args.int8_rows}))
    except ConfigError as error:
        raise options.UsageError(f"--pool-pages {args.pool_pages}: {error.allowed}") from None
    model = spec.load()
    batch = Engine(model, config, batch_config)
    prompt_ids = batch.encode(prompt)
    check_prompt_fits(config, prompt_ids, model.config)
    ids = batch.submit_parallel(prompt_ids, args.n)
    records, started = [], time.perf_counter()
    interrupted = False
    try:
        run(batch, on_step=records.append)
    except (CacheFullError, SwapSpaceError) as error:
        print(f"pagevis run: stopped: {getattr(error, 'strerror', None) or error}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        for seq_id in ids:
            batch.cancel(seq_id, "interrupted")
    finally:
        batch.close()
    summary = {"model": spec.label, "prompt_tokens": len(batch.requests[ids[0]].prompt_ids),
               **batch.cache.storage(),
               "policy": config.policy, "max_pages": config.max_pages, **batch_summary(batch, records,
                                                                                      time.perf_counter() - started),
               "samples": [{"seed": batch.requests[i].sampler.config.seed, "text": batch.text(i),
                            "generated_tokens": len(batch.requests[i].generated),
                            "stop_reason": batch.requests[i].stop_reason} for i in ids]}
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        for sample in summary["samples"]:
            print(f"--- sample seed {sample['seed']} ---\n{sample['text']}")
        print(f"pages: {summary['pages_used_peak']} used with sharing, {summary['pages_without_sharing_peak']} "
              f"without, {summary['copy_on_write']} copied on write", file=sys.stderr)
    return 130 if interrupted else 0

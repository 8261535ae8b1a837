"""`pagevis run --teacher-forced FILE`: the chosen cache and policy read a text, scored token by token.

compare's machinery for one configuration: the full cache's reference over the text's first --tokens tokens,
then the run's own cache teacher-forced through the same text (pagevis.engine.teacher_forced). `ppl` and
`full_ppl` are the numbers `pagevis compare` gives for the same text, tokens, cache and policy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagevis.cli import options
from pagevis.cli.options import UsageError

CAP = 4096  # tokens run --teacher-forced reads of a text by default (the whole text when shorter); --tokens N for more


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--teacher-forced", metavar="FILE",
                        help="read FILE (a UTF-8 text, or a shipped text's name such as pride-and-prejudice-ch1 "
                             "or the-ferry-timetable) through the cache instead of decoding, and report each "
                             "token's negative log-likelihood, the perplexity and the full cache's on the same "
                             "tokens (the numbers of `pagevis compare` for this cache and policy)")
    parser.add_argument("--tokens", type=int, metavar="N",
                        help=f"with --teacher-forced: read the text's first N tokens, scoring the N - 1 "
                             f"predictions among them (default: the whole text, at most {CAP} tokens; stderr says "
                             f"when that cap cut it)")


def main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from pagevis.quality import measure as quality
    from pagevis.cli.compare import MAX_TOKENS, load_text
    from pagevis.engine.teacher_forced import TeacherForced, perplexity
    from pagevis.kvcache import CacheFullError

    tokens = CAP if args.tokens is None else args.tokens
    options.check_range("--tokens", tokens, 2, MAX_TOKENS)
    for flag, given in (("--trace", args.trace), ("--n", args.n > 1), ("--prompt", getattr(args, "prompt", None))):
        if given:
            raise UsageError(f"{flag} does not apply with --teacher-forced (it reads a text, it does not decode)")
    spec = options.model_spec(args)
    config = replace(options.session_config(args), record_layers=())
    text = load_text(args.teacher_forced)
    model = spec.load()
    whole = model.tokenizer.encode(text)
    ids = whole[:tokens]
    if args.tokens is None and len(whole) > CAP:
        print(f"run --teacher-forced: read the first {CAP} of the text's {len(whole)} tokens (the default cap; "
              f"--tokens N reads N)", file=sys.stderr)
    if len(ids) < 2:
        raise UsageError("--teacher-forced: the text is too short: it must encode to at least 2 tokens")
    started = time.perf_counter()
    with quality.full_reference(model, ids, page_size=config.page_size, dtype="float32") as reference:
        forced = TeacherForced(model, ids, config)
        try:
            scores = quality.score(forced, reference)
        except CacheFullError as error:
            raise UsageError(f"--teacher-forced: {error} (policy {config.policy} never evicts: give it "
                             f"--max-pages for {len(ids)} tokens, or another policy)") from None
        finally:
            forced.close()
        full_ppl = reference.perplexity()
    evicting = slice(min(config.capacity, len(ids) - 1), len(ids) - 1)
    result = {
        "model": spec.label, "text": args.teacher_forced, "text_tokens": len(ids), "tokens": len(ids) - 1,
        "text_total_tokens": len(whole),
        "policy": config.policy, "page_size": config.page_size, "max_pages": config.max_pages,
        "capacity": config.capacity, "dtype": config.dtype,
        "ppl": perplexity(-scores.logprobs), "full_ppl": full_ppl,
        "ppl_evicting": perplexity(-scores.logprobs[evicting]),
        "full_ppl_evicting": reference.perplexity(evicting.start) if evicting.start < len(ids) - 1 else None,
        "evictions": scores.evictions, "seconds": time.perf_counter() - started,
        "nll": [round(float(x), 6) for x in -scores.logprobs],
    }
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    evict = ("" if result["ppl_evicting"] is None else
             f"; once full (tokens {evicting.start + 1}-{len(ids) - 1}): ppl {result['ppl_evicting']:.3f}, full "
             f"cache {result['full_ppl_evicting']:.3f}")
    print(f"{spec.label}, {config.policy} in {config.max_pages} pages of {config.page_size}, {len(ids) - 1} "
          f"tokens of {args.teacher_forced} predicted: ppl {result['ppl']:.3f}, full cache {full_ppl:.3f}{evict}; "
          f"{scores.evictions} evictions")
    if not args.quiet:
        print(f"run --teacher-forced: took {result['seconds']:.0f} s", file=sys.stderr)
    return 0

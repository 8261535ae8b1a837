"""KVzip's compare row next to the streaming rows on the same tokens (docs/policies.md, "KVzip ... Measured").

compare's kvzip row at budget B prefills the text's first C = n - B tokens (whole pages), compresses them to B and
scores only the predictions after them (positions >= C). This script evaluates every row from one full-cache
reference (pagevis.quality.measure, as compare does) and prints each row's perplexity over positions >= C from its
per-token log-probabilities (Row.logprobs); then, for the kvzip compression alone, the share of the 16 newest
context tokens each (layer, KV head) kept, read from the engine's per-head masks, and the heads' budgets.

Usage: python scripts/kvzip_same_tokens.py [--tokens 512] [--budgets 64,128]
"""

from __future__ import annotations

import argparse
from importlib import resources

import numpy as np

from pagevis.quality import measure
from pagevis.quality.measure import PolicyChoice, perplexity
from pagevis.engine import DecodeSession, ModelSpec, SessionConfig

ROWS = [("optimal", {}), ("kvzip", {}), ("tova", {}), ("snapkv", {}), ("sinks", {}), ("adakv", {}),
        ("kvzip", {"n_sink": 0})]
PAGE_SIZE = 16


def same_tokens(model, ids, budgets) -> None:
    with measure.full_reference(model, ids, PAGE_SIZE) as reference:
        for budget in budgets:
            rows = [measure.evaluate(model, reference, PolicyChoice(name, params), budget, PAGE_SIZE)
                    for name, params in ROWS]
            start = next(row.scored_from for row in rows if row.scored_from is not None)
            print(f"budget {budget}: positions >= {start}, full cache {reference.perplexity(start):.3f}")
            for row in rows:
                print(f"  {row.policy:<16} ppl from {start} {perplexity(row.logprobs[start:]):8.3f}  "
                      f"(ppl evict over its own tokens {row.ppl_evicting:.3f})")


def recent_kept(model, ids, budget: int, context: int, newest: int = 16) -> None:
    config = SessionConfig(page_size=PAGE_SIZE, max_pages=context // PAGE_SIZE, policy="kvzip", chat=False,
                           max_new_tokens=1, policy_params={"budget": budget})
    session = DecodeSession(model, "", config, prompt_ids=ids[:context])
    session.step()
    cache = session.cache
    shares = []
    for layer, store in enumerate(cache.stores):
        flat = cache.flat_slots(session.seq_id, layer)
        recent = store.positions[flat] >= context - newest
        shares.append(cache.head_keep(session.seq_id, layer)[:, flat[recent]].sum(axis=1) / newest)
    shares, budgets = np.array(shares), session.policy.head_budgets
    print(f"budget {budget}, context {context}: the {newest} newest context tokens kept by a (layer, KV head): "
          f"{shares.mean():.0%} on average, none by {int((shares == 0).sum())} of {shares.size}; head budgets "
          f"{budgets.min()}-{budgets.max()}, median {np.median(budgets):g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budgets", default="64,128")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    model = ModelSpec().load()
    text = resources.files("pagevis.resources").joinpath("texts/pride-and-prejudice-ch1.txt").read_text("utf-8")
    ids = model.tokenizer.encode(text)[: args.tokens]
    same_tokens(model, ids, budgets)
    for budget in budgets:
        recent_kept(model, ids, budget, (len(ids) - budget) // PAGE_SIZE * PAGE_SIZE)


if __name__ == "__main__":
    main()

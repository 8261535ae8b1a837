"""How many int4 / int2 key groups and window rows a teacher-forced run keeps in use, step by step, against
what the bytes formula counts (one key group per 32 slots; the window's max(residual, 1) + 31 tokens).

    .venv/bin/python scripts/key_group_census.py [--policies sinks,tova,h2o] [--budget 256] [--tokens 512]

The shipped text goes through a DecodeSession as its prompt, as `pagevis compare` feeds it (the budget in one
prefill chunk, then a token a step). After every step but the prefill, the largest count over the layers
is taken. Under eviction a key group's scale and zero point stay while any of its tokens does, so policies
that keep a few tokens of many groups (H2O, TOVA) keep more groups than the formula: docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def census(model, ids, policy: str, budget: int, dtype: str, residual: int, page_size: int = 16) -> dict:
    from pagevis.engine import DecodeSession, SessionConfig

    config = SessionConfig(page_size=page_size, max_pages=budget // page_size, policy=policy, dtype=dtype,
                           residual=residual, max_new_tokens=1, chat=False, record_layers=(), oracle=False)
    session = DecodeSession(model, "", config, prompt_ids=ids)
    groups, rows = [], []
    for step, _ in enumerate(session.run()):
        session.records[-1] = None
        if step:
            groups.append(max(store.groups.in_use for store in session.cache.stores))
            rows.append(max(store.residual.in_use for store in session.cache.stores))
    layout = session.cache.stores[0].layout
    return {"policy": policy, "budget": budget, "dtype": dtype, "residual": residual,
            "key_groups_max": max(groups), "key_groups_mean": float(np.mean(groups)),
            "key_groups_formula": -(-budget // layout.group), "window_max": max(rows),
            "window_mean": float(np.mean(rows)), "window_formula": layout.window(), "steps": len(groups)}


def main() -> None:
    from pagevis.cli.compare import load_text
    from pagevis.model import load_model, set_blas_threads

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="sinks,tova,h2o")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="int4", choices=["int4", "int2"])
    parser.add_argument("--residual", type=int, default=0)
    args = parser.parse_args()
    set_blas_threads(1)
    model = load_model()
    ids = [int(t) for t in model.tokenizer.encode(load_text(None))[: args.tokens]]
    for policy in args.policies.split(","):
        print(json.dumps(census(model, ids, policy, args.budget, args.dtype, args.residual)), flush=True)


if __name__ == "__main__":
    main()

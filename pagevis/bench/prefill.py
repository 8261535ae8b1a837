"""Prefill throughput, the cost of log-likelihood requests: m concurrent prompts of n tokens, each scoring
every prompt token (what lm-eval's loglikelihood asks), prefilled by the engine, against the machine's sgemm
rate at the model's own prefill shape.

With a token budget of m x n the m prompts prefill in ONE engine step — one forward whose weight products
take all m x n rows — so the step count is part of the row: more than one means the batch was split.
A scored prompt keeps the logits of all its rows (n x vocab float32: 100 MB for 512 SmolLM2 tokens), so a
row's memory grows with m x n; the default sizes (8 x 512: 805 MB of logits) fit the machines we run on.
"""

from __future__ import annotations

import time

import numpy as np

from pagevis.engine import Engine, SessionConfig
from pagevis.engine.batch import BatchConfig

CONCURRENT = (1, 8)
PROMPT_TOKENS = 512


def sgemm_gflops(rows: int, inner: int, cols: int, repeats: int = 5) -> float:
    """float32 matmul (rows, inner) @ (inner, cols): best-of GFLOP/s on this machine, now."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, inner), dtype=np.float32)
    b = rng.standard_normal((inner, cols), dtype=np.float32)
    best = np.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * cols / best / 1e9


def prefill_row(model, concurrent: int, tokens: int = PROMPT_TOKENS, seed: int = 0) -> dict:
    """`concurrent` scored prompts of `tokens` random ids, submitted at once and prefilled by the engine;
    the seconds of the steps that fed them."""
    cfg = model.config
    page_size = 16
    config = SessionConfig(page_size=page_size, max_pages=-(-(tokens + 1) // page_size), policy="none",
                           max_new_tokens=1, oracle=False, record_layers=())
    engine = Engine(model, config, BatchConfig(max_seqs=concurrent, token_budget=concurrent * tokens,
                                               prefix_caching=False), max_chunk=tokens)
    rng = np.random.default_rng(seed)
    for _ in range(concurrent):
        engine.submit(rng.integers(0, cfg.vocab_size, tokens), max_new_tokens=1, scores=(None, 0))
    started = time.perf_counter()
    steps = 0
    for record in engine.run():
        steps += 1
        if all(s.next_token >= 0 for s in record.seqs):
            break
    seconds = time.perf_counter() - started
    engine.close()
    params = sum(w.size for w in model.weights.matrices())
    flops = 2 * params * concurrent * tokens
    return {"concurrent": concurrent, "tokens": tokens, "steps": steps, "seconds": seconds,
            "tokens_per_s": concurrent * tokens / seconds, "gflops": flops / seconds / 1e9}


def run_prefill_bench(model, concurrents=CONCURRENT, tokens: int = PROMPT_TOKENS) -> dict:
    cfg = model.config
    rate = sgemm_gflops(tokens, cfg.d_model, cfg.d_ff)
    rows = [prefill_row(model, m, tokens) for m in concurrents]
    for row in rows:
        row["of_sgemm"] = row["gflops"] / rate
    return {"rows": rows, "sgemm_gflops": rate, "sgemm_shape": [tokens, cfg.d_model, cfg.d_ff]}


def format_prefill(result: dict) -> list[str]:
    rows, shape = result["rows"], result["sgemm_shape"]
    out = [f"Prefill of scored prompts (log-likelihood requests: every prompt token's log-probability kept), "
           f"{rows[0]['tokens']} tokens each, all submitted at once; sgemm {result['sgemm_gflops']:.1f} GFLOP/s at "
           f"({shape[0]} x {shape[1]}) @ ({shape[1]} x {shape[2]}), float32",
           f"{'prompts':>8} {'steps':>6} {'seconds':>8} {'tok/s':>8} {'GFLOP/s':>8} {'of sgemm':>9}"]
    for r in rows:
        out.append(f"{r['concurrent']:>8} {r['steps']:>6} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} "
                   f"{r['gflops']:>8.1f} {r['of_sgemm']:>9.2f}")
    out.append("GFLOP/s counts the weight products only (2 x parameters per token, the logits' included); "
               "attention and the softmax of every row's logits are on top.")
    return out

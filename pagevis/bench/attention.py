"""Paged decode attention against dense contiguous attention over the same resident tokens.

Run `python -m pagevis.bench.attention` for the table. Both sides use SmolLM2's layer shape by default
(9 query heads, 3 KV heads, head dim 64) and the same query, keys and values; the paged side is the
engine's whole per-layer attention call (occupancy mask, kernel and the policy's score bookkeeping).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from pagevis.kvcache import CacheConfig, KVCacheManager, attend

CONTEXTS = (32, 128, 512, 1024, 2048, 4096, 8192)
PAGE_SIZES = (8, 16, 32, 64)


def filled_cache(context: int, page_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 dtype: str, rng: np.random.Generator) -> tuple[KVCacheManager, np.ndarray, np.ndarray]:
    """A one-layer cache holding `context` tokens, and the same keys/values laid out densely."""
    config = CacheConfig(page_size=page_size, max_pages=math.ceil(context / page_size), n_layers=1,
                         n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype,
                         policy="none")
    cache = KVCacheManager.single(config)
    keys = rng.standard_normal((context, n_kv_heads, head_dim)).astype(dtype)
    values = rng.standard_normal((context, n_kv_heads, head_dim)).astype(dtype)
    cache.append(0, 0, keys, values, np.arange(context))
    cache.take_events()
    dense_k = np.ascontiguousarray(keys.transpose(1, 0, 2))
    dense_v = np.ascontiguousarray(values.transpose(1, 0, 2))
    return cache, dense_k, dense_v


def best_time(fn, repeats: int) -> float:
    """Median of `repeats` timings of fn(), in seconds (median: robust to a noisy shared machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run_attention_bench(contexts=CONTEXTS, page_sizes=PAGE_SIZES, n_heads=9, n_kv_heads=3, head_dim=64,
                        dtype="float32", repeats=None, seed=0) -> list[dict]:
    """One row per (context, page size): paged and dense seconds per decode-step attention and their ratio."""
    rng = np.random.default_rng(seed)
    rows = []
    for context in contexts:
        reps = repeats or max(20, min(400, 400_000 // context))
        for page_size in page_sizes:
            cache, dense_k, dense_v = filled_cache(context, page_size, n_heads, n_kv_heads, head_dim, dtype, rng)
            q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
            position = np.array([context])
            paged = lambda: cache.attend(0, 0, q, position)
            dense = lambda: attend(q, dense_k, dense_v)
            check = np.abs(paged().output - dense().output).max()
            assert check < 1e-4, f"paged and dense disagree by {check}"
            # interleave the two so drifting machine load hits both alike
            paged_s, dense_s = [], []
            for _ in range(5):
                paged_s.append(best_time(paged, reps // 5 + 1))
                dense_s.append(best_time(dense, reps // 5 + 1))
            p, d = float(np.median(paged_s)), float(np.median(dense_s))
            rows.append(dict(context=context, page_size=page_size, dtype=dtype, paged_us=p * 1e6,
                             dense_us=d * 1e6, ratio=p / d))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'context':>8} {'page':>5} {'dtype':>8} {'paged µs':>10} {'dense µs':>10} {'paged/dense':>12}"]
    for r in rows:
        lines.append(f"{r['context']:>8} {r['page_size']:>5} {r['dtype']:>8} {r['paged_us']:>10.1f} "
                     f"{r['dense_us']:>10.1f} {r['ratio']:>11.3f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.attention", description=__doc__)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = parser.parse_args(argv)
    rows = run_attention_bench([int(c) for c in args.contexts.split(",")],
                               [int(p) for p in args.page_sizes.split(",")], dtype=args.dtype)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

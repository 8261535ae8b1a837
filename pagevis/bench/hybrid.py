"""A hybrid cache measured: Gemma 3 270M's layout (18 layers, 4 query / 1 KV head, head_dim 256; layers 5, 11, 17
global, the rest a 512-token sliding window), filled to each context through the engine's cache, one local and
one global layer (the others are copies of one of them): the bytes each kind held at most between steps, and one
decode query's attention time per layer kind, beside what the same cache would hold without windows."""

from __future__ import annotations

import numpy as np

from pagevis.bench.attention import best_time

GEMMA3_270M = dict(n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256, window=512, global_every=6)
CHUNK = 512  # prompt tokens per step, as the engine's prefill chunks (MAX_CHUNK)


def hybrid_rows(contexts, page_size: int = 16, dtype: str = "float16", layout: dict = GEMMA3_270M,
                repeats: int | None = None, seed: int = 0) -> list[dict]:
    from pagevis.kvcache import CacheConfig, KVCacheManager
    from pagevis.kvcache.memory import hybrid_bytes, modelled_bytes
    from pagevis.kvcache.layer_spec import layer_specs
    from pagevis.model.synthetic import window_pattern

    rng = np.random.default_rng(seed)
    heads, kv, dim, window = layout["n_heads"], layout["n_kv_heads"], layout["head_dim"], layout["window"]
    specs = layer_specs(window_pattern(layout["n_layers"], window, layout["global_every"]), layout["n_layers"])
    rows = []
    for context in contexts:
        reps = repeats or max(20, min(200, 200_000 // context))
        config = CacheConfig(page_size=page_size, max_pages=-(-context // page_size), n_layers=2, n_heads=heads,
                             n_kv_heads=kv, head_dim=dim, dtype=dtype, policy="none", sliding_windows=(window, None))
        cache = KVCacheManager.single(config)
        for start in range(0, context, CHUNK):  # a chunk a step; the local layer slides after each
            positions = np.arange(start, min(start + CHUNK, context))
            for layer in range(2):
                k, v = rng.standard_normal((2, len(positions), kv, dim)).astype(np.float32)
                cache.append(0, layer, k, v, positions)
            cache.commit(0)
        q = rng.standard_normal((1, heads, dim)).astype(np.float32)
        last = np.array([context - 1])
        local_us, global_us = (best_time(lambda layer=layer: cache.attend(0, layer, q, last), reps) * 1e6
                               for layer in range(2))
        measured = [cache.pool(0 if spec.window else 1).peak for spec in specs]  # pages, per layer
        held = hybrid_bytes(specs, measured, config.page_bytes(), context, page_size)
        modelled = modelled_bytes(CacheConfig(**{**config.cache_settings(), "max_pages": 1}, n_layers=len(specs),
                                              n_heads=heads, n_kv_heads=kv, head_dim=dim,
                                              sliding_windows=tuple(s.window for s in specs)), context)
        rows.append(dict(context=context, page_size=page_size, dtype=dtype, window=window,
                         local_layers=held.n_local, global_layers=held.n_global, kv_bytes_local=held.local,
                         kv_bytes_global=held.global_, kv_bytes_hybrid=held.hybrid, kv_bytes_without_windows=held.full,
                         hybrid_over_full=held.hybrid / held.full, modelled_bytes_hybrid=modelled.hybrid,
                         local_us=local_us, global_us=global_us))
        cache.close()
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    first = rows[0]
    out = [f"Hybrid cache: Gemma 3 270M's layout ({first['local_layers']} local layers W={first['window']}, "
           f"{first['global_layers']} global; 1 KV head, d 256, {first['dtype']}, page {first['page_size']}), "
           "measured on one layer of each kind",
           f"{'context':>8} {'local KiB':>10} {'global KiB':>11} {'hybrid KiB':>11} {'no windows KiB':>15} "
           f"{'ratio':>6} {'local µs':>9} {'global µs':>10}"]
    for r in rows:
        out.append(f"{r['context']:>8} {r['kv_bytes_local'] / 1024:>10.0f} {r['kv_bytes_global'] / 1024:>11.0f} "
                   f"{r['kv_bytes_hybrid'] / 1024:>11.0f} {r['kv_bytes_without_windows'] / 1024:>15.0f} "
                   f"{r['hybrid_over_full']:>6.3f} {r['local_us']:>9.1f} {r['global_us']:>10.1f}")
    return out

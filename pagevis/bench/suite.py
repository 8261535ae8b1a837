"""The parts of `pagevis bench` beyond paged-vs-dense attention (pagevis.bench.attention): float16 vs
float32 storage, torch's scaled_dot_product_attention on the same data (when torch is installed), and the
model's decode speed against the memory-bandwidth floor (read bandwidth / weight bytes per token)."""

from __future__ import annotations

import time

import numpy as np

from pagevis.bench.attention import best_time, filled_cache

SMOLLM2_LAYER = dict(n_heads=9, n_kv_heads=3, head_dim=64)  # the shape the attention rows use


def kv_bytes(context: int, dtype: str, n_kv_heads: int = 3, head_dim: int = 64) -> int:
    """K and V bytes one layer holds for `context` tokens."""
    return 2 * context * n_kv_heads * head_dim * np.dtype(dtype).itemsize


def storage_rows(float32_rows: list[dict], float16_rows: list[dict]) -> list[dict]:
    """Pair the attention bench's float32 and float16 rows: time and memory of each storage."""
    by_key = {(r["context"], r["page_size"]): r for r in float16_rows}
    rows = []
    for r in float32_rows:
        half = by_key.get((r["context"], r["page_size"]))
        if half is None:
            continue
        rows.append(dict(context=r["context"], page_size=r["page_size"], f32_us=r["paged_us"],
                         f16_us=half["paged_us"], f16_over_f32=half["paged_us"] / r["paged_us"],
                         f32_kv_bytes=kv_bytes(r["context"], "float32"),
                         f16_kv_bytes=kv_bytes(r["context"], "float16")))
    return rows


def quantized_rows(contexts, page_size: int = 16, residual: int = 128, repeats: int | None = None, seed: int = 0,
                   dtypes=("float32", "float16", "int8", "int4", "int2")) -> list[dict]:
    """Decode attention over one layer of `context` tokens per storage dtype (SmolLM2's layer shape), on the
    same float32 keys and values: the engine's attention call (dequantizing a block of pages at a time), its
    output's relative error against float32 storage, and the exact K/V bytes per token (one layer: pages,
    scales, zero points, key groups, and int4 / int2's window of residual + 31 float32 tokens)."""
    from pagevis.kvcache import CacheConfig, KVCacheManager
    from pagevis.kvcache.quant import storage_summary

    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = SMOLLM2_LAYER["n_heads"], SMOLLM2_LAYER["n_kv_heads"], SMOLLM2_LAYER["head_dim"]
    rows = []
    for context in contexts:
        reps = repeats or max(20, min(200, 200_000 // context))
        keys = rng.standard_normal((context, kv_heads, dim)).astype(np.float32)
        values = rng.standard_normal((context, kv_heads, dim)).astype(np.float32)
        q = rng.standard_normal((1, heads, dim)).astype(np.float32)
        reference = None
        for dtype in dtypes:
            config = CacheConfig(page_size=page_size, max_pages=-(-context // page_size), n_layers=1, n_heads=heads,
                                 n_kv_heads=kv_heads, head_dim=dim, dtype=dtype, residual=residual, policy="none")
            cache = KVCacheManager.single(config)
            # the prompt, then one decode token: its append quantizes what is past the window, as in decoding
            cache.append(0, 0, keys[:-1], values[:-1], np.arange(context - 1))
            cache.append(0, 0, keys[-1:], values[-1:], np.array([context - 1]))
            position = np.array([context - 1])
            output = cache.attend(0, 0, q, position).output
            reference = output if reference is None else reference
            seconds = best_time(lambda cache=cache: cache.attend(0, 0, q, position), reps)
            per_token = storage_summary(config)["kv_bytes_per_token"]
            rows.append(dict(context=context, page_size=page_size, dtype=dtype, residual=residual,
                             paged_us=seconds * 1e6, kv_bytes_per_token=per_token,
                             kv_bytes=round(per_token * config.capacity),
                             rel_error=float(np.linalg.norm(output - reference) / np.linalg.norm(reference))))
        first = rows[-len(dtypes)]["paged_us"]
        for row in rows[-len(dtypes):]:
            row["over_first"] = row["paged_us"] / first
    return rows


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_rows(contexts, page_size: int = 16, repeats: int | None = None, seed: int = 0,
               threads: int | None = None, dtypes=("float32", "float16")) -> list[dict]:
    """Paged (engine), dense NumPy and torch SDPA decode attention on the same query, keys and values, per
    storage dtype. torch reads the 3 KV heads directly (enable_gqa), as the engine does, so both read the
    same bytes; `threads` sets torch's intra-op threads (give it as many as our BLAS threads). A dtype torch
    cannot run on this CPU gets a row with torch_us None and its error in `note`."""
    import torch
    import torch.nn.functional as F

    from pagevis.kvcache import attend

    if threads:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = SMOLLM2_LAYER["n_heads"], SMOLLM2_LAYER["n_kv_heads"], SMOLLM2_LAYER["head_dim"]
    rows = []
    for dtype in dtypes:
        for context in contexts:
            reps = repeats or max(20, min(400, 400_000 // context))
            cache, dense_k, dense_v = filled_cache(context, page_size, heads, kv_heads, dim, dtype, rng)
            q = rng.standard_normal((1, heads, dim)).astype(np.float32)
            tq = torch.from_numpy(q.transpose(1, 0, 2)[None].astype(dtype))  # (1, heads, 1, dim)
            tk, tv = torch.from_numpy(dense_k[None]), torch.from_numpy(dense_v[None])  # (1, kv_heads, context, dim)
            position = np.array([context])
            paged = lambda: cache.attend(0, 0, q, position)
            dense = lambda: attend(q, dense_k, dense_v)

            def sdpa():
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

            row = dict(context=context, dtype=dtype, page_size=page_size, kv_bytes=kv_bytes(context, dtype),
                       torch_threads=torch.get_num_threads(), torch_version=torch.__version__, note="")
            try:
                got = sdpa()[0, :, 0].float().numpy()
            except RuntimeError as error:  # e.g. no half-precision kernel on this CPU
                rows.append({**row, "paged_us": best_time(paged, reps) * 1e6, "dense_us": None, "torch_us": None,
                             "paged_over_torch": None, "note": str(error).splitlines()[0][:200]})
                continue
            check = np.abs(got - paged().output[0]).max()
            assert check < (1e-4 if dtype == "float32" else 1e-2), f"torch and the engine disagree by {check}"
            times = {"paged": [], "dense": [], "torch": []}
            for _ in range(5):  # interleaved, so drifting machine load hits all three alike
                for name, fn in (("paged", paged), ("dense", dense), ("torch", sdpa)):
                    times[name].append(best_time(fn, reps // 5 + 1))
            p, d, t = (float(np.median(times[name])) for name in ("paged", "dense", "torch"))
            rows.append({**row, "paged_us": p * 1e6, "dense_us": d * 1e6, "torch_us": t * 1e6,
                         "paged_over_torch": p / t})
    return rows


def decode_row(spec, n_tokens: int = 32, probe_bytes: int | None = None) -> dict:
    """Decode tokens/s of a model on the paged engine (a DecodeSession, default cache settings) and on
    the model's plain dense attention, against the bandwidth floor: read bandwidth / weight bytes per token.

    The read bandwidth (pagevis.bench.bandwidth.measure_read_bandwidth) is measured on a weight-sized array
    before and after decoding and the best is kept, so a quiet moment in either counts. The copy figure
    (each byte counted once) is reported beside it for reference; it is not a floor. A share of the
    floor above 1.0 is impossible and listed in `warnings`.
    """
    from pagevis.engine import DecodeSession, SessionConfig
    from pagevis.bench import bandwidth

    started = time.perf_counter()
    model = spec.load()
    load_s = time.perf_counter() - started
    per_token = bandwidth.weight_bytes_per_token(model)
    probe = probe_bytes or per_token
    copy = bandwidth.measure_copy_bandwidth(probe)
    before = bandwidth.measure_read_bandwidth(probe)
    # 16 pages of 16: room for the default 32 tokens without eviction (the row times decoding, not a policy)
    config = SessionConfig(page_size=16, max_pages=16, max_new_tokens=n_tokens + 1, chat=False, record_layers=())
    session = DecodeSession(model, "The paged cache", config)
    decode_s = [r.timings["total"] for r in session.run() if r.kind == "decode"]
    paged = 1 / float(np.median(decode_s))
    dense = bandwidth.measure_decode_speed(model, n_tokens=n_tokens)
    shapes = bandwidth.shape_read_rates(model)
    after = bandwidth.measure_read_bandwidth(probe)
    read = {key: max(before[key], after[key]) for key in before}
    floor = read["read"] / per_token
    row = dict(model=spec.label, load_s=load_s, weight_mb_per_token=per_token / 1e6, probe_mb=probe / 1e6,
               read_gb_s=read["read"] / 1e9, gemv_gb_s=read["gemv"] / 1e9, reduce_gb_s=read["reduce"] / 1e9,
               floor_tok_s=floor, copy_gb_s=copy / 1e9, copy_tok_s=copy / per_token,
               paged_tok_s=paged, dense_tok_s=dense, paged_of_floor=paged / floor, dense_of_floor=dense / floor,
               decode_steps=len(decode_s), shapes=shapes)
    row["warnings"] = [f"{name} decoding at {row[f'{name}_of_floor']:.2f} of the read floor is impossible: the "
                       f"bandwidth probe was slowed (a busy machine?) or the weights were not all read"
                       for name in ("paged", "dense") if row[f"{name}_of_floor"] > 1.0]
    return row


def transformers_row(spec, python: str | None, n_tokens: int, threads: int) -> dict | None:
    """transformers eager decode speed on the same GGUF file with `threads` torch threads (the same count
    as our BLAS threads, for a like-for-like comparison), run by `python` (this interpreter when it has
    transformers and torch); None when neither is available or the model is synthetic."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    if spec.kind == "synthetic":
        return None
    if python is None:
        if not (importlib.util.find_spec("transformers") and importlib.util.find_spec("torch")):
            return None
        python = sys.executable
    from pagevis.model import default_model_path

    gguf = spec.path if spec.kind == "gguf" else str(default_model_path())
    script = Path(__file__).with_name("transformers_eager.py")
    done = subprocess.run([python, str(script), "--gguf", gguf, "--tokens", str(n_tokens), "--threads", str(threads)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"transformers benchmark failed under {python}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


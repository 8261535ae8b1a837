"""The parts of `pagevis bench` beyond paged-vs-dense attention (pagevis.bench.attention): float16 vs
float32 storage, torch's scaled_dot_product_attention on the same data (when torch is installed), and the
model's decode speed against the memory-bandwidth floor."""

from __future__ import annotations

import time

import numpy as np

from .attention import best_time, filled_cache

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


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_rows(contexts, page_size: int = 16, repeats: int | None = None, seed: int = 0) -> list[dict]:
    """Paged (engine), dense NumPy and torch SDPA decode attention on the same query, keys and values."""
    import torch
    import torch.nn.functional as F

    from ..engine import attend

    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = SMOLLM2_LAYER["n_heads"], SMOLLM2_LAYER["n_kv_heads"], SMOLLM2_LAYER["head_dim"]
    rows = []
    for context in contexts:
        reps = repeats or max(20, min(400, 400_000 // context))
        cache, dense_k, dense_v = filled_cache(context, page_size, heads, kv_heads, dim, "float32", rng)
        q = rng.standard_normal((1, heads, dim)).astype(np.float32)
        group = heads // kv_heads
        tq = torch.from_numpy(q.transpose(1, 0, 2)).unsqueeze(0)  # (1, heads, 1, dim)
        # repeat KV heads for GQA, once, outside the timed call (torch's enable_gqa is not in every version)
        tk = torch.from_numpy(np.repeat(dense_k, group, axis=0)).unsqueeze(0)  # (1, heads, context, dim)
        tv = torch.from_numpy(np.repeat(dense_v, group, axis=0)).unsqueeze(0)
        position = np.array([context])
        paged = lambda: cache.attend(0, q, position)
        dense = lambda: attend(q, dense_k, dense_v)

        def sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv)

        check = np.abs(sdpa()[0, :, 0].numpy() - paged().output[0]).max()
        assert check < 1e-4, f"torch and the engine disagree by {check}"
        p, d, t = (best_time(fn, reps) for fn in (paged, dense, sdpa))
        rows.append(dict(context=context, page_size=page_size, paged_us=p * 1e6, dense_us=d * 1e6,
                         torch_us=t * 1e6, paged_over_torch=p / t, torch_threads=torch.get_num_threads()))
    return rows


def decode_row(spec, n_tokens: int = 32, copy_bytes: int | None = None) -> dict:
    """Decode tokens/s of a model on the paged engine (a DecodeSession, default cache settings) and on
    the model's plain dense attention, against the bandwidth floor (copy bandwidth / weight bytes)."""
    from ..decoding import DecodeSession, SessionConfig
    from ..model import speed

    started = time.perf_counter()
    model = spec.load()
    load_s = time.perf_counter() - started
    bandwidth = speed.measure_copy_bandwidth(**({"nbytes": copy_bytes} if copy_bytes else {}))
    per_token = speed.weight_bytes_per_token(model)
    floor = bandwidth / per_token
    session = DecodeSession(model, "The paged cache", SessionConfig(max_new_tokens=n_tokens + 1, chat=False,
                                                                     record_layers=()))
    decode_s = [r.timings["total"] for r in session.run() if r.kind == "decode"]
    forward_s = float(np.median(decode_s))
    dense = speed.measure_decode_speed(model, n_tokens=n_tokens)
    return dict(model=spec.label, load_s=load_s, copy_gb_s=bandwidth / 1e9, weight_mb_per_token=per_token / 1e6,
                floor_tok_s=floor, paged_tok_s=1 / forward_s, dense_tok_s=dense,
                paged_of_floor=(1 / forward_s) / floor, dense_of_floor=dense / floor, decode_steps=len(decode_s))


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
    from ..model import default_model_path

    gguf = spec.path if spec.kind == "gguf" else str(default_model_path())
    script = Path(__file__).with_name("transformers_eager.py")
    done = subprocess.run([python, str(script), "--gguf", gguf, "--tokens", str(n_tokens), "--threads", str(threads)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"transformers benchmark failed under {python}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


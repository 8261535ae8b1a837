"""Find SmolLM2's retrieval and streaming heads for the `duo` policy (DuoAttention) on a shipped text.

Method. The text (Chapters II-VI of the shipped Pride and Prejudice, 2,048 tokens from "Chapter II": the
default `compare` text is Chapter I, so the evaluation never sees the calibration text) runs once through
the model with the full cache. At every layer, for every query past the first n_sink + recent positions,
each query head's attention output is computed twice: over every earlier token (full attention, what the
model uses) and over the n_sink first and `recent` newest tokens only (a streaming head). A head's score is
the mean relative error ||o_full - o_stream|| / ||o_full|| over those queries, averaged over the query heads
of each KV head (the cache is per KV head, so a KV head is streaming or retrieval as a whole): how much the
head's output changes when it forgets the middle of the context. DuoAttention (Xiao et al. 2024,
arXiv:2410.10819) learns a gate per head by optimising the model's final hidden states with and without
streaming on passkey-retrieval data, which needs gradients; this is the per-head, gradient-free version of
the same question on plain prose. Also written: the share of attention a streaming head would lose.

Usage: python scripts/calibrate_duo.py [--tokens 2048] [--out resources/calibration/duo-smollm2-135m.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

from pagevis.kvcache.policies.duo import DuoAttention

ROOT = Path(__file__).resolve().parent.parent
TEXT = "texts/pride-and-prejudice-ch1-6.txt"
START = "Chapter II"


def calibrate(model, ids: np.ndarray, n_sink: int, recent: int, chunk: int = 256) -> dict:
    cfg = model.config
    n, group = len(ids), cfg.n_heads // cfg.n_kv_heads
    keys = np.zeros((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), np.float32)
    values = np.zeros_like(keys)
    error = np.zeros((cfg.n_layers, cfg.n_heads))
    lost = np.zeros((cfg.n_layers, cfg.n_heads))
    counted = 0

    def attend(layer, q, k, v, positions):
        nonlocal counted
        keys[layer, positions], values[layer, positions] = k, v
        upto = positions[-1] + 1
        kk = np.repeat(keys[layer, :upto], group, axis=1).transpose(1, 0, 2).astype(np.float64)  # (heads, T, d)
        vv = np.repeat(values[layer, :upto], group, axis=1).transpose(1, 0, 2).astype(np.float64)
        scores = np.einsum("nhd,htd->nht", q.astype(np.float64), kk) / np.sqrt(cfg.head_dim)
        key_pos = np.arange(upto)
        scores[(key_pos[None, :] > positions[:, None])[:, None, :].repeat(cfg.n_heads, axis=1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        full = np.einsum("nht,htd->nhd", weights, vv)
        window = (key_pos[None, :] < n_sink) | (key_pos[None, :] > positions[:, None] - recent)  # (n, T)
        kept = weights * window[:, None, :]
        mass = kept.sum(axis=-1)
        stream = np.einsum("nht,htd->nhd", kept / mass[..., None], vv)
        rows = positions >= n_sink + recent  # queries a streaming head answers differently
        if rows.any():
            diff = np.linalg.norm(full[rows] - stream[rows], axis=-1) / np.linalg.norm(full[rows], axis=-1)
            error[layer] += diff.sum(axis=0)
            lost[layer] += (1 - mass[rows]).sum(axis=0)
            if layer == 0:
                counted += int(rows.sum())
        return full.astype(np.float32)

    for start in range(0, n, chunk):
        positions = np.arange(start, min(start + chunk, n))
        model.forward(ids[positions], positions, attend)
    per_kv = lambda a: (a / counted).reshape(cfg.n_layers, cfg.n_kv_heads, group).mean(axis=2)  # noqa: E731
    return {"scores": per_kv(error), "lost_attention": per_kv(lost), "queries": counted}


def compact_json(data: dict) -> str:
    """Indented JSON with each innermost list of numbers on one line."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", default=str(ROOT / "resources" / "calibration" / "duo-smollm2-135m.json"))
    args = parser.parse_args()
    from pagevis.model import load_model, set_blas_threads

    set_blas_threads(1)
    model = load_model()
    text = (ROOT / "resources" / TEXT).read_text("utf-8")
    text = text[text.index(START):]
    ids = np.asarray(model.tokenizer.encode(text)[: args.tokens], dtype=np.int64)
    n_sink, recent = DuoAttention.n_sink, DuoAttention.recent
    started = time.perf_counter()
    result = calibrate(model, ids, n_sink, recent)
    cfg = model.config
    scores = result["scores"]
    order = np.argsort(scores, axis=None)
    out = {
        "model": "SmolLM2-135M-Instruct",
        "layout": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
                   "head_dim": cfg.head_dim},
        "text": f"resources/{TEXT}, {len(ids)} tokens from {START!r} (no chat template)",
        "n_sink": n_sink, "recent": recent, "queries": result["queries"],
        "method": "per (layer, KV head): mean over queries past n_sink + recent and over the KV head's query "
                  "heads of ||o_full - o_stream|| / ||o_full||, o_stream = attention over the n_sink first and "
                  "recent newest tokens only (scripts/calibrate_duo.py)",
        "scores": np.round(scores, 6).tolist(),
        "lost_attention": np.round(result["lost_attention"], 6).tolist(),
        "streaming_order": [[int(i // cfg.n_kv_heads), int(i % cfg.n_kv_heads)] for i in order],
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(compact_json(out) + "\n")
    print(f"wrote {args.out}: {result['queries']} queries, {out['seconds']} s")
    print("score per layer (KV heads):")
    for layer, row in enumerate(scores):
        print(f"  {layer:2d}  " + "  ".join(f"{x:.3f}" for x in row))


if __name__ == "__main__":
    main()

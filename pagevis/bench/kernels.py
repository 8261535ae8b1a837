"""The model-side kernels, measured in one run: batched decode through the forward pass, and decode attention
against the read bandwidth (and torch's SDPA when torch is installed).

Batched decode here is the model's own: one `forward` over the rows of m sequences (`logit_rows`), each row
attending over its own DenseAttention. It does not go through pagevis.engine (the engine's batch session),
so it measures the kernels alone. A decode step reads every weight once whatever m is, so the floor of a step
is weight bytes / read bandwidth; m rows add 2 x parameters x m FLOPs, which is what the blocked products
(pagevis.model.matmul) keep cheap. Run `python -m pagevis.bench.kernels`.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from pagevis.model import DenseAttention
from pagevis.model.matmul import GEMM_ONLY
from pagevis.bench.bandwidth import measure_read_bandwidth

BATCH_SIZES = (1, 2, 4, 8, 16)
SMOLLM2_LAYER = dict(n_heads=9, n_kv_heads=3, head_dim=64)


def _decode_steps(model, m: int, steps: int, prompt: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of each of `steps` decode forwards of m sequences together (greedy,
    DenseAttention each)."""
    vocab = model.config.vocab_size
    caches = [DenseAttention(model.config) for _ in range(m)]
    tokens = np.empty(m, dtype=np.int64)
    for i, cache in enumerate(caches):
        ids = (np.arange(prompt) * 7919 + 104729 * (i + 1)) % vocab  # a different prompt per sequence
        tokens[i] = int(np.argmax(model.forward(ids, np.arange(prompt), cache)))

    def attend(layer, q, k, v, positions):
        return np.concatenate([cache(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], positions[i:i + 1])
                               for i, cache in enumerate(caches)])

    rows = np.arange(m)
    wall, cpu = [], []
    for step in range(steps):
        positions = np.full(m, prompt + step)
        start, start_cpu = time.perf_counter(), time.process_time()
        logits = model.forward(tokens, positions, attend, logit_rows=rows)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        tokens = np.argmax(logits, axis=1)
    return wall, cpu


def batched_rows(model, sizes=BATCH_SIZES, steps: int = 8, prompt: int = 16, rounds: int = 3,
                 compare_gemm: bool = True) -> dict:
    """Per batch size m: median step time of a forward over m sequences' rows (best of `rounds` rounds, the
    sizes interleaved so drifting load hits all alike), aggregate tokens/s and its ratio to one sequence; the
    same with plain gemm for every product (the path before the blocked kernel) when compare_gemm; and the
    read floor of a step (weight bytes / read bandwidth of a weight-sized array, measured before and after).
    CPU time beside wall-clock: on a machine shared with other jobs the process also waits for a core, which
    wall-clock counts and its own CPU time does not."""
    weight_bytes = model.weights.nbytes_per_token()
    params = sum(w.size for w in model.weights.matrices())
    before = measure_read_bandwidth(weight_bytes)["read"]
    plans = {"plan": model.plan, "gemm": GEMM_ONLY} if compare_gemm else {"plan": model.plan}
    best = {(name, m): np.inf for name in plans for m in sizes}
    best_cpu = {m: np.inf for m in sizes}
    saved = model.plan
    try:
        for _ in range(rounds):
            for m in sizes:
                for name, plan in plans.items():
                    model.plan = plan
                    wall, cpu = _decode_steps(model, m, steps, prompt)
                    best[name, m] = min(best[name, m], statistics.median(wall))
                    if name == "plan":
                        best_cpu[m] = min(best_cpu[m], statistics.median(cpu))
    finally:
        model.plan = saved
    read = max(before, measure_read_bandwidth(weight_bytes)["read"])
    floor = weight_bytes / read
    rows = []
    for m in sizes:
        row = {"sequences": m, "step_ms": best["plan", m] * 1e3, "tokens_per_s": m / best["plan", m],
               "over_one": best["plan", sizes[0]] / best["plan", m] * m / sizes[0],
               "of_floor": floor / best["plan", m], "gflops": 2 * params * m / best["plan", m] / 1e9,
               "cpu_step_ms": best_cpu[m] * 1e3, "cpu_over_one": best_cpu[sizes[0]] / best_cpu[m] * m / sizes[0]}
        if compare_gemm:
            row.update(gemm_step_ms=best["gemm", m] * 1e3,
                       gemm_over_one=best["gemm", sizes[0]] / best["gemm", m] * m / sizes[0])
        rows.append(row)
    warnings = [f"{r['sequences']} sequences at {r['of_floor']:.2f} of the read floor is impossible: the bandwidth "
                f"probe was slowed (a busy machine?)" for r in rows if r["of_floor"] > 1.0]
    return {"rows": rows, "read_gb_s": read / 1e9, "floor_ms": floor * 1e3, "weight_mb": weight_bytes / 1e6,
            "params": params, "plan": model.plan.describe(), "steps": steps, "prompt": prompt, "warnings": warnings}


def attention_row(context: int = 8192, repeats: int = 200, seed: int = 0, torch_threads: int | None = None) -> dict:
    """Decode attention (one query, SmolLM2's layer shape, float32) over `context` tokens: K/V bytes read per
    second, as a fraction of the read bandwidth of an array of the same size (the same cache level: a timed
    loop keeps both warm) and of a weight-sized one (memory), and beside torch's SDPA when torch is installed."""
    from pagevis.kvcache import attend

    from pagevis.bench.attention import best_time
    from pagevis.bench.suite import torch_available

    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = SMOLLM2_LAYER["n_heads"], SMOLLM2_LAYER["n_kv_heads"], SMOLLM2_LAYER["head_dim"]
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    keys = rng.standard_normal((kv_heads, context, dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, context, dim)).astype(np.float32)
    kv_bytes = keys.nbytes + values.nbytes
    ours = lambda: attend(q, keys, values)
    sdpa = _torch_sdpa(q, keys, values, torch_threads) if torch_available() else None
    times = {"ours": [], "torch": []}
    for _ in range(5):  # interleaved, so drifting machine load hits both alike
        times["ours"].append(best_time(ours, repeats // 5 + 1))
        if sdpa is not None:
            times["torch"].append(best_time(sdpa, repeats // 5 + 1))
    seconds = float(np.median(times["ours"]))
    same_size = measure_read_bandwidth(kv_bytes, repeats=20)["read"]
    row = {"context": context, "kv_mb": kv_bytes / 1e6, "us": seconds * 1e6, "gb_s": kv_bytes / seconds / 1e9,
           "read_same_size_gb_s": same_size / 1e9, "of_read": kv_bytes / seconds / same_size,
           "torch_us": None, "ours_over_torch": None}
    if sdpa is not None:
        import torch

        torch_s = float(np.median(times["torch"]))
        row.update(torch_us=torch_s * 1e6, ours_over_torch=seconds / torch_s, torch_version=torch.__version__,
                   torch_threads=torch.get_num_threads())
    return row


def _torch_sdpa(q, keys, values, threads):
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    tq = torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2))[None])  # (1, heads, 1, dim)
    tk, tv = torch.from_numpy(keys[None]), torch.from_numpy(values[None])  # (1, kv_heads, context, dim)

    def sdpa():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    return sdpa


def format_kernels(result: dict) -> list[str]:
    b = result["batched"]
    out = [f"Batched decode, the model's kernels alone (one forward over m sequences' rows, each row attending "
           f"over its own DenseAttention; not the engine's batch session), {b['steps']} steps after a "
           f"{b['prompt']}-token prompt",
           f"  a step reads {b['weight_mb']:.0f} MB of weights: floor {b['floor_ms']:.1f} ms at {b['read_gb_s']:.2f} "
           f"GB/s read; m rows add 2 x {b['params'] / 1e6:.0f}M x m FLOPs",
           f"{'sequences':>10} {'step ms':>8} {'tok/s':>7} {'x one':>7} {'floor/step':>11} {'GFLOP/s':>8} "
           f"{'CPU ms':>7} {'x one':>7}"
           + (f" {'gemm ms':>8} {'x one':>7}" if "gemm_step_ms" in b["rows"][0] else "")]
    for r in b["rows"]:
        line = (f"{r['sequences']:>10} {r['step_ms']:>8.1f} {r['tokens_per_s']:>7.1f} {r['over_one']:>6.2f}x "
                f"{r['of_floor']:>11.2f} {r['gflops']:>8.1f} {r['cpu_step_ms']:>7.1f} {r['cpu_over_one']:>6.2f}x")
        if "gemm_step_ms" in r:
            line += f" {r['gemm_step_ms']:>8.1f} {r['gemm_over_one']:>6.2f}x"
        out.append(line)
    out += [f"  WARNING: {w}" for w in b["warnings"]]
    if b["plan"]:
        out.append("  kernels (rows:kernel per weight shape in x out; xwB/wxB: blocks of B output columns, gemm: BLAS):")
        out += [f"    {line}" for line in b["plan"]]
        if any("(under load)" in line for line in b["plan"]):
            out.append("  WARNING: some plans were measured while other processes were busy; they are measured again "
                       "by themselves once the machine is quiet, or now with --remeasure-plans")
    else:
        out.append("  kernels: BLAS gemm only (this model has no measured plan: load_model measures one)")
    a = result["attention"]
    out.append(f"Decode attention, {a['context']} float32 tokens (9 query / 3 KV heads, d 64, {a['kv_mb']:.1f} MB of "
               f"K/V): {a['us']:.0f} µs, {a['gb_s']:.1f} GB/s = {a['of_read']:.2f} of the read bandwidth of the same "
               f"bytes ({a['read_same_size_gb_s']:.1f} GB/s)")
    if a["torch_us"] is not None:
        out.append(f"  torch {a['torch_version']} SDPA ({a['torch_threads']} threads) {a['torch_us']:.0f} µs: ours "
                   f"{a['ours_over_torch']:.2f}x torch's time")
    else:
        out.append("  torch: not installed (make torch) for the SDPA comparison")
    return out


def run_kernel_bench(model, sizes=BATCH_SIZES, steps: int = 8, context: int = 8192, threads: int | None = None,
                     quick: bool = False) -> dict:
    """Both parts; `quick`: 1, 2 and 4 sequences, 2 steps, one round, no gemm comparison, 512 tokens."""
    if quick:
        return {"batched": batched_rows(model, (1, 2, 4), 2, rounds=1, compare_gemm=False),
                "attention": attention_row(512, repeats=10, torch_threads=threads)}
    return {"batched": batched_rows(model, sizes, steps), "attention": attention_row(context, torch_threads=threads)}


def main(argv=None) -> int:
    import argparse

    from pagevis.model import load_model, set_blas_threads

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.kernels", description=__doc__)
    parser.add_argument("--sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--blas-threads", type=int, default=1)
    args = parser.parse_args(argv)
    set_blas_threads(args.blas_threads)
    result = run_kernel_bench(load_model(), [int(s) for s in args.sizes.split(",")], args.steps, args.context,
                              args.blas_threads)
    print("\n".join(format_kernels(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Many sequences over one pool, measured: aggregate decode tokens/s with continuous batching at several
batch sizes, the pages parallel sampling uses, and the prefix-cache hit rate of a shared system prompt."""

from __future__ import annotations

import statistics
import time

from pagevis.engine import SamplingConfig, SessionConfig
from pagevis.engine import Engine, run
from pagevis.engine.batch import BatchConfig
from pagevis.engine.batch_summary import batch_summary

BATCH_SIZES = (1, 2, 4, 8, 16)
QUESTIONS = ("What is a page table?", "Why do caches evict?", "Name a prime number.", "What is attention?",
             "Define a block table.", "What is copy-on-write?", "Why share a prefix?", "What is a token?")
SYSTEM_PROMPT = ("You are a careful assistant for an operating systems course. Answer in one short paragraph, "
                 "define every term you use, prefer concrete numbers to adjectives, cite the classic paper when "
                 "one exists, and say plainly when a question has no single answer. Students read your answers "
                 "on small screens, so keep sentences short, avoid tables, and never use more than three "
                 "examples. When a question is about memory, mention pages, frames and the cost of a miss, and "
                 "when it is about caches, mention what is evicted first and why that choice was made.")


def _config(model_spec_kind: str, max_new_tokens: int, page_size: int = 16, max_pages: int = 32,
            mode: str = "greedy") -> SessionConfig:
    return SessionConfig(page_size=page_size, max_pages=max_pages, policy="none", max_new_tokens=max_new_tokens,
                         chat=model_spec_kind != "synthetic", sampling=SamplingConfig(mode=mode))


def batching_rows(model, kind: str, sizes=BATCH_SIZES, n_tokens: int = 12, exact: bool = False) -> list[dict]:
    """Aggregate decode tokens/s with B sequences decoding together (median step time of the steps in
    which all B decode one token), and its ratio to one sequence. Wall-clock and CPU time both: on a
    machine shared with other jobs the process waits for a core, which wall-clock counts and CPU time
    (this process's own, memory stalls included) does not. exact: BatchConfig.int8_rows "none" (float32 rows,
    each the row alone), else "batched" (int8 rows where the CPU has VNNI: model/int8_rows.py)."""
    rows = []
    for size in sizes:
        batch = Engine(model, _config(kind, n_tokens + 1),
                       BatchConfig(max_seqs=size, int8_rows="none" if exact else "batched"))
        for i in range(size):
            batch.submit(batch.encode(QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"))
        wall, cpu, clock = [], [], [time.process_time()]

        def timed(record, size=size, wall=wall, cpu=cpu, clock=clock):
            now = time.process_time()
            if len(record.seqs) == size and all(s.kind == "decode" for s in record.seqs):
                wall.append(record.seconds)
                cpu.append(now - clock[0])
            clock[0] = now

        run(batch, on_step=timed)
        step, cpu_step = statistics.median(wall), statistics.median(cpu)
        rows.append({"sequences": size, "step_ms": step * 1e3, "tokens_per_s": size / step,
                     "cpu_step_ms": cpu_step * 1e3, "cpu_tokens_per_s": size / cpu_step, "steps": len(wall)})
    for row in rows:
        row["over_one"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["cpu_over_one"] = row["cpu_tokens_per_s"] / rows[0]["cpu_tokens_per_s"]
    return rows


def parallel_sampling_row(model, kind: str, n: int = 4, prompt_tokens: int = 200, new_tokens: int = 64) -> dict:
    """n samples of one prompt_tokens-token prompt, new_tokens each (end-of-sequence ignored, so the shape is
    the one asked for): pages at the peak against one sequence's and against no sharing."""
    config = _config(kind, new_tokens, mode="sample")
    batch = Engine(model, config, BatchConfig(max_seqs=n, ignore_eos=True))
    ids = batch.encode(" ".join(["pages"] * prompt_tokens))[:prompt_tokens]
    batch.submit_parallel(ids, n)
    records = list(batch.run())
    summary = batch_summary(batch, records, sum(r.seconds for r in records))
    summary["pages_over_one"] = summary["pages_used_peak"] / summary["pages_one_sequence"]
    summary["unshared_over_one"] = summary["pages_without_sharing_peak"] / summary["pages_one_sequence"]
    summary["ideal_over_one"] = (prompt_tokens + n * new_tokens) / (prompt_tokens + new_tokens)
    summary["all_ran_to_length"] = all(len(s.generated) == new_tokens for s in batch.requests.values())
    return summary


def shared_prompt_row(model, kind: str, n: int = 8, system_tokens: int = 150, new_tokens: int = 4) -> dict:
    """n sequences, one after another, whose prompts open with the same system_tokens-token system prompt
    (then a different question each): the prefix-cache hit rate over those shared tokens, for every
    sequence after the first (at most the full pages of the system prompt can hit)."""
    batch = Engine(model, _config(kind, new_tokens), BatchConfig(max_seqs=n))
    system = list(model.tokenizer.encode(SYSTEM_PROMPT))
    system = (system * (system_tokens // len(system) + 1))[:system_tokens]
    hits = []
    for i in range(n):
        before = batch.cache.prefix_stats.hits
        batch.submit(system + batch.encode(QUESTIONS[i % len(QUESTIONS)]))
        run(batch)
        hits.append(min(batch.cache.prefix_stats.hits - before, system_tokens))
    later = hits[1:]
    return {"sequences": n, "system_tokens": system_tokens, "page_size": batch.config.page_size,
            "hit_tokens": hits, "hit_rate_after_first": sum(later) / (system_tokens * len(later))}


def format_sequences(result: dict) -> list[str]:
    out = ["Many sequences, one pool (continuous batching, one engine)",
           f"{'sequences':>10} {'step ms':>9} {'tok/s':>8} {'x one':>7} {'CPU ms':>8} {'CPU tok/s':>10} {'x one':>7}"]
    for r in result["batching"]:
        out.append(f"{r['sequences']:>10} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.1f} {r['over_one']:>6.2f}x "
                   f"{r['cpu_step_ms']:>8.1f} {r['cpu_tokens_per_s']:>10.1f} {r['cpu_over_one']:>6.2f}x")
    out.append(f"  {result.get('rows', '')}")
    ratios = {r["sequences"]: r["over_one"] for r in result["batching"]}
    if 8 in ratios and 16 in ratios:
        out.append(f"  8 sequences {ratios[8]:.2f}x one sequence's rate, 16 {ratios[16]:.2f}x (targets 3.5x and 5x: "
                   "docs/speed.md, batches)")
    p = result["parallel"]
    out.append(f"  parallel sampling n={p['sequences']}: {p['pages_used_peak']} pages at the peak vs "
               f"{p['pages_one_sequence']} for one sequence ({p['pages_over_one']:.2f}x; no sharing "
               f"{p['unshared_over_one']:.2f}x; the arithmetic floor (prompt + n x new) / (prompt + new) is "
               f"{p['ideal_over_one']:.2f}x), {p['copy_on_write']} copies on write")
    s = result["shared_prompt"]
    out.append(f"  shared {s['system_tokens']}-token system prompt over {s['sequences']} sequences: prefix-cache "
               f"hit rate {s['hit_rate_after_first']:.0%} after the first (tokens hit per sequence: "
               f"{s['hit_tokens']})")
    return out


def run_sequences_bench(model, kind: str, n_tokens: int = 12, sizes=BATCH_SIZES) -> dict:
    from pagevis.model import int8_rows

    return {"batching": batching_rows(model, kind, sizes, n_tokens), "rows": int8_rows.describe(),
            "parallel": parallel_sampling_row(model, kind),
            "shared_prompt": shared_prompt_row(model, kind)}

"""The disk tier's memory-vs-latency trade-off, measured in one run (`python -m pagevis.bench.tiers`, and
the tier tables and plots of `pagevis bench`).

- streamed: exact decode attention over a context whose pages live on disk, with R RAM frames (half keep
  pages, half take disk pages in batches merged by log-sum-exp), against paged attention with every page
  in RAM. Warm: the swap file is in the OS page cache (as after the first step); cold: one step right after
  the file's pages were dropped from the page cache (fdatasync + POSIX_FADV_DONTNEED).
- quest: decode attention reading only K pages per step, chosen by per-page key bounds, against reading
  all of them, at the same RAM; every step has its own random query, so the pages it picks change.
- memory: a session's anonymous memory (RssAnon) after a prompt of 4k to 32k tokens with RAM fixed at
  16 frames of 16 tokens (synthetic model, no attention recorded), each in a fresh process.
All layer shapes are SmolLM2's (9 query heads, 3 KV heads, head dim 64) except the memory rows'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from pagevis.kvcache import CacheConfig, KVCacheManager
from pagevis.bench.attention import best_time

SHAPE = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64}
CONTEXTS = (2048, 8192, 32768)
RAM_SHARES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
QUEST_SHARES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4)
RSS_CONTEXTS = (4096, 8192, 16384, 32768)


def keys_values(context: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (context, SHAPE["n_kv_heads"], SHAPE["head_dim"])
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def tiered_cache(kv: tuple[np.ndarray, np.ndarray], page_size: int, ram_frames: int | None, select: str = "all",
                 select_pages: int = 4, swap_dir: str | None = None) -> KVCacheManager:
    """A one-layer cache holding these keys and values: on a disk tier of exactly as many pages with
    `ram_frames` RAM frames, or (ram_frames None) every page in RAM."""
    context = len(kv[0])
    pages = math.ceil(context / page_size)
    tiers = {"max_pages": pages} if ram_frames is None else {"max_pages": ram_frames, "disk_pages": pages}
    cache = KVCacheManager.single(CacheConfig(page_size=page_size, n_layers=1, policy="none", select=select,
                                     select_pages=select_pages, swap_dir=swap_dir, **tiers, **SHAPE))
    cache.admission.ensure_room(0, context)
    cache.append(0, 0, kv[0], kv[1], np.arange(context))
    cache.take_events()
    cache.take_counts()
    return cache


def ram_frames_for(pages: int, share: float) -> int:
    return max(2, round(pages * share))


def streamed_rows(contexts=CONTEXTS, shares=RAM_SHARES, page_size: int = 16, repeats: int | None = None,
                  seed: int = 0, swap_dir: str | None = None) -> list[dict]:
    """Per context and RAM share: microseconds per exact decode attention, warm and cold, against all in
    RAM. The two are timed in alternating rounds, so that a drifting machine load hits both alike."""
    rng = np.random.default_rng(seed)
    rows = []
    for context in contexts:
        pages = math.ceil(context / page_size)
        reps = repeats or max(3, min(40, 80_000 // context))
        kv = keys_values(context, seed)
        ram = tiered_cache(kv, page_size, None)
        q = rng.standard_normal((1, SHAPE["n_heads"], SHAPE["head_dim"])).astype(np.float32)
        position = np.array([context])
        for share in shares:
            frames = ram_frames_for(pages, share)
            cache = tiered_cache(kv, page_size, frames, swap_dir=swap_dir)
            exact = np.abs(cache.attend(0, 0, q, position).output - ram.attend(0, 0, q, position).output).max()
            assert exact < 1e-4, f"streamed and in-RAM attention disagree by {exact}"
            cache.take_counts()
            ram_s, warm_s = [], []
            for _ in range(5):
                ram_s.append(best_time(lambda ram=ram: ram.attend(0, 0, q, position), reps))
                warm_s.append(best_time(lambda cache=cache: cache.attend(0, 0, q, position), reps))
            counts = cache.take_counts()[0]
            cold = cold_time(cache, q, position)
            ram_us, warm_us = float(np.median(ram_s)) * 1e6, float(np.median(warm_s)) * 1e6
            rows.append({"context": context, "page_size": page_size, "pages": pages, "ram_frames": frames,
                         "ram_share": frames / pages, "ram_us": ram_us, "warm_us": warm_us,
                         "warm_over_ram": warm_us / ram_us, "cold_us": cold * 1e6,
                         "mb_read_per_step": counts.bytes_read / (5 * reps) / 1e6,
                         "hit_rate": counts.hits / (counts.hits + counts.faults)})
            cache.close()
    return rows


def cold_time(cache: KVCacheManager, q: np.ndarray, position: np.ndarray) -> float:
    """One decode attention right after the swap file's pages left the OS page cache."""
    fd = cache.swap.files[0].fd
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    cache.attend(0, 0, q, position)
    return time.perf_counter() - start


def quest_rows(context: int = 8192, ram_share: float = 1 / 8, shares=QUEST_SHARES, page_size: int = 16,
               steps: int = 40, seed: int = 0, swap_dir: str | None = None) -> list[dict]:
    """Microseconds per decode attention reading K pages (quest) against reading all, at the same RAM."""
    rng = np.random.default_rng(seed)
    pages = math.ceil(context / page_size)
    frames = ram_frames_for(pages, ram_share)
    queries = rng.standard_normal((steps, 1, SHAPE["n_heads"], SHAPE["head_dim"])).astype(np.float32)
    position = np.array([context])

    def per_step(cache) -> tuple[float, float]:
        cache.attend(0, 0, queries[0], position)  # warm the page cache
        cache.take_counts()
        times = []
        for q in queries:
            start = time.perf_counter()
            cache.attend(0, 0, q, position)
            times.append(time.perf_counter() - start)
        counts = cache.take_counts()[0]
        cache.close()
        return float(np.median(times)), counts.faults / steps

    kv = keys_values(context, seed + 1)  # the same keys for every row
    all_s, all_faults = per_step(tiered_cache(kv, page_size, frames, swap_dir=swap_dir))
    rows = []
    for share in shares:
        k = max(1, round(pages * share))
        quest_s, faults = per_step(tiered_cache(kv, page_size, frames, "quest", k, swap_dir))
        rows.append({"context": context, "pages": pages, "ram_frames": frames, "select_pages": k,
                     "select_share": k / pages, "all_us": all_s * 1e6, "quest_us": quest_s * 1e6,
                     "quest_over_all": quest_s / all_s, "faults_per_step": faults, "all_faults_per_step": all_faults})
    return rows


RSS_SCRIPT = """
import json, os, sys, time
import numpy as np
from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
context, disk_pages = int(sys.argv[1]), int(sys.argv[2])
swap_dir = sys.argv[3] if len(sys.argv) > 3 else None
model = ModelSpec(kind="synthetic").load()
ids = np.random.default_rng(0).integers(3, model.config.vocab_size, context).tolist()
config = SessionConfig(page_size=16, max_pages=16, disk_pages=disk_pages, policy="sinks", max_new_tokens=8,
                       chat=False, record_layers=(), swap_dir=swap_dir)
started = time.perf_counter()
session = DecodeSession(model, "", config, prompt_ids=ids)
for _ in session.run():
    pass
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda key: int(status[key].split()[0])
print(json.dumps({"context": context, "rss_anon_kib": kib("RssAnon"), "rss_file_kib": kib("RssFile"),
                  "vm_hwm_kib": kib("VmHWM"), "swap_file_bytes": session.cache.swap.file_bytes(),
                  "steps": len(session.records), "seconds": time.perf_counter() - started}))
session.cache.close()
"""


def rss_rows(contexts=RSS_CONTEXTS, swap_dir: str | None = None) -> list[dict]:
    """Each context in a fresh process: anonymous memory after the prompt and 8 decoded tokens."""
    disk_pages = max(contexts) // 16 + 16
    rows = []
    for context in contexts:
        argv = [sys.executable, "-c", RSS_SCRIPT, str(context), str(disk_pages)] + ([swap_dir] if swap_dir else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
        if done.returncode:
            raise RuntimeError(f"the memory run at {context} tokens failed: {done.stderr.strip()[-400:]}")
        rows.append({**json.loads(done.stdout), "disk_pages": disk_pages, "ram_frames": 16, "page_size": 16})
    base = rows[0]["rss_anon_kib"]
    for row in rows:
        row["rss_anon_over_first"] = row["rss_anon_kib"] / base
    return rows


def format_tables(streamed: list[dict], quest: list[dict], rss: list[dict] | None) -> list[str]:
    out = ["Disk tier: exact streamed decode attention vs every page in RAM (one layer, 9q/3kv heads, d 64)",
           f"{'context':>8} {'pages':>6} {'RAM':>5} {'share':>7} {'in RAM µs':>10} {'warm µs':>9} {'warm/RAM':>9} "
           f"{'cold µs':>9} {'MB/step':>8} {'hits':>6}"]
    for r in streamed:
        out.append(f"{r['context']:>8} {r['pages']:>6} {r['ram_frames']:>5} {r['ram_share']:>7.3f} "
                   f"{r['ram_us']:>10.0f} {r['warm_us']:>9.0f} {r['warm_over_ram']:>8.2f}x {r['cold_us']:>9.0f} "
                   f"{r['mb_read_per_step']:>8.2f} {r['hit_rate']:>6.3f}")
    if quest:
        first = quest[0]
        out += ["", f"Quest: K pages read per step vs all {first['pages']} pages, {first['context']} tokens, "
                    f"{first['ram_frames']} RAM frames (a new random query each step)",
                f"{'K':>5} {'share':>7} {'quest µs':>9} {'all µs':>8} {'quest/all':>10} {'faults/step':>12}"]
        for r in quest:
            out.append(f"{r['select_pages']:>5} {r['select_share']:>7.3f} {r['quest_us']:>9.0f} {r['all_us']:>8.0f} "
                       f"{r['quest_over_all']:>9.3f}x {r['faults_per_step']:>12.1f}")
    if rss:
        out += ["", f"Memory: RAM fixed at 16 frames of 16 tokens, {rss[0]['disk_pages']} disk pages, synthetic model, "
                    "no attention recorded",
                f"{'context':>8} {'RssAnon MiB':>12} {'vs first':>9} {'VmHWM MiB':>10} {'swap file MiB':>14} {'s':>6}"]
        for r in rss:
            out.append(f"{r['context']:>8} {r['rss_anon_kib'] / 1024:>12.1f} {r['rss_anon_over_first']:>8.3f}x "
                       f"{r['vm_hwm_kib'] / 1024:>10.1f} {r['swap_file_bytes'] / 2**20:>14.1f} {r['seconds']:>6.1f}")
    return out


def write_plots(folder: str, streamed: list[dict], quest: list[dict], line_plot) -> list[str]:
    """bench-tiers.png and bench-quest.png, drawn by `line_plot` (pagevis.plots.line_plot: the benches
    import no Qt, so the caller passes it in)."""
    written = []
    series = {}
    for context in sorted({r["context"] for r in streamed}):
        rows = [r for r in streamed if r["context"] == context]
        series[f"{context} tokens, disk tier (warm)"] = ([r["ram_share"] for r in rows], [r["warm_us"] for r in rows])
        series[f"{context} tokens, all in RAM"] = ([min(r["ram_share"] for r in rows), 1.0], [rows[0]["ram_us"]] * 2)
    path = os.path.join(folder, "bench-tiers.png")
    line_plot(path, series, "Exact decode attention vs share of pages in RAM (rest on disk)",
              "RAM frames / pages", "latency per step (µs)", log_x=True, log_y=True,
              dashed={label for label in series if "all in RAM" in label},
              x_ticks=sorted({round(r["ram_share"], 3) for r in streamed} | {1.0}))
    written.append(path)
    if quest:
        path = os.path.join(folder, "bench-quest.png")
        line_plot(path, {"quest (K pages)": ([r["select_pages"] for r in quest], [r["quest_us"] for r in quest]),
                         "all pages": ([r["select_pages"] for r in quest], [r["all_us"] for r in quest])},
                  f"Quest vs reading every page ({quest[0]['context']} tokens, {quest[0]['ram_frames']} RAM frames)",
                  "K (pages read per step)", "latency per step (µs)", log_x=True,
                  x_ticks=[r["select_pages"] for r in quest], dashed={"all pages"})
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pagevis.bench.tiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--no-rss", action="store_true", help="skip the memory rows (a process per context)")
    parser.add_argument("--swap-dir", help="where the swap files go (default: the system's temporary folder)")
    parser.add_argument("--out", help="folder for bench-tiers.json (`pagevis bench --out DIR` also draws "
                                      "bench-tiers.png and bench-quest.png)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    streamed = streamed_rows(contexts, swap_dir=args.swap_dir)
    quest = quest_rows(8192 if 8192 in contexts else contexts[-1], swap_dir=args.swap_dir)
    rss = None if args.no_rss else rss_rows(swap_dir=args.swap_dir)
    print("\n".join(format_tables(streamed, quest, rss)))
    if args.out:
        with open(os.path.join(args.out, "bench-tiers.json"), "w", encoding="utf-8") as handle:
            json.dump({"streamed": streamed, "quest": quest, "rss": rss}, handle, indent=1)
        print(f"wrote {os.path.join(args.out, 'bench-tiers.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`pagevis bench engine`: decoding as `pagevis run` does it, beside the bare model and llama.cpp, and where a step's
time goes.

Three engines per model file, each on 1 and 2 threads, each configuration in its own process (its own peak RSS),
the configurations interleaved round by round (load from other processes falls on all alike), medians over rounds:
  engine     `pagevis run --no-chat --policy none --page-size 16`'s path: a DecodeSession (the paged cache, the
             scheduler, the step record, the run loop and a hook as `run`'s progress bar), configured as `run` is;
  model      the bare `model.forward` with a DenseAttention (what `bench weights` measures);
  llama.cpp  llama-cpp-python (the `bench` extra), when installed.
Each decodes greedily after a 23-token and after a 512-token prompt (the same token ids for all three): decode
tokens/s from the first decoded token to the last (wall clock), prefill tokens/s of the prompt, and the peak RSS
when that prompt's decode ended. After the timed tokens the pagevis engines decode a few more with every part timed
(weights, attention, the rest of the forward, sampling, the scheduler and cache bookkeeping, the record, the Python
between steps): per token, in ms, measured in the same process right after the timed run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pagevis.bench import weights
from pagevis.bench.weights import _cpu, _peak_rss, _prompt_ids, llama_cpp_available, llama_cpp_worker

PROMPTS = (23, 512)
PAGE_SIZE = 16
TEXT = "pride-and-prejudice-ch1"  # the policies' prompt: presets.DEFAULT_TEXT, compare's text
POLICY_PAGES = 16  # the policies' row: 16 pages of 16 tokens, after a 512-token prompt every step evicts


class PolicyRun(NamedTuple):
    """A policy the bench decodes with: its row's label (as --policies names it), its name and its parameters."""

    label: str
    name: str
    params: dict


def plain(name: str) -> PolicyRun:
    return PolicyRun(name, name, {})


# the policies that choose tokens (adakv: KV heads' entries) under the cache's budget as each one arrives (not
# kvzip's one-shot compression, threshold's pruning, the page policies, duo's per-layer budgets), sinks first:
# the others' rates are said over its rate in the same round
TOKEN_POLICIES = (*map(plain, ("sinks", "oldest", "h2o", "tova", "snapkv", "pyramidkv", "keydiff")),
                  plain("expected-attention"),
                  PolicyRun("expected-attention:compress_every=1", "expected-attention", {"compress_every": 1}),
                  *map(plain, ("adakv", "merge", "random")))
SPLIT_TOKENS = 16  # tokens decoded with every part timed, after the timed ones
ENGINES = ("engine", "model", "llama.cpp")
PARTS = ("weights", "attention", "forward_rest", "sampling", "bookkeeping", "record", "between")


class _Clock:
    """Seconds spent inside wrapped callables, by part."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, function):
        seconds, clock = self.seconds, time.perf_counter

        def timed(*args, **kwargs):
            begin = clock()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += clock() - begin

        return timed


@contextmanager
def _timed_products(clock: _Clock):
    """Every weight product of the forward (model/decoder.py's matmul) timed as 'weights'."""
    from pagevis.model import decoder

    original = decoder.matmul
    decoder.matmul = clock.wrap("weights", original)
    try:
        yield
    finally:
        decoder.matmul = original


def _run_config(prompt: int, new_tokens: int):
    """The session `pagevis run --no-chat --policy none --page-size 16 --max-pages N --max-tokens M` decodes with
    (everything else the settings table's defaults, as `run` has them)."""
    from pagevis.engine import SessionConfig

    pages = -(-(prompt + new_tokens + 1) // PAGE_SIZE)
    # (without --trace, run's records keep no layer's attention)
    return SessionConfig(page_size=PAGE_SIZE, max_pages=pages, policy="none", max_new_tokens=new_tokens, chat=False,
                         record_layers=())


def policy_config(policy: str, params: dict, new_tokens: int):
    """`pagevis run --no-chat --policy P [--policy-param K=V ...] --page-size 16 --max-pages 16`: a 256-token cache,
    so that after a longer prompt every step evicts."""
    from pagevis.engine import SessionConfig

    return SessionConfig(page_size=PAGE_SIZE, max_pages=POLICY_PAGES, policy=policy, policy_params=params,
                         max_new_tokens=new_tokens, chat=False, record_layers=())


def _text_ids(model, n: int) -> list[int]:
    """The first n tokens of a shipped text (a policy's cost depends on what attention does), repeated if short."""
    from importlib import resources

    text = resources.files("pagevis.resources").joinpath(f"texts/{TEXT}.txt").read_text("utf-8")
    ids = model.tokenizer.encode(text)
    return (ids * -(-n // len(ids)))[:n]


def engine_worker(path: str, threads: int, decode: int, prompts=PROMPTS, policy: str | None = None,
                  policy_params: dict | None = None) -> dict:
    """`run`'s decode with the whole prompt cached (policy None), or in POLICY_PAGES pages under `policy` with
    `policy_params` (the shipped text's tokens as the prompt)."""
    from pagevis.engine import DecodeSession, ModelSpec
    from pagevis.model import set_blas_threads
    from pagevis.model.weight_threads import set_weight_threads

    set_blas_threads(1)
    set_weight_threads(threads)
    start = time.perf_counter()
    model = ModelSpec(kind="gguf", path=path).load()
    out = {"load_s": time.perf_counter() - start}
    for n in prompts:
        if policy is None:
            config = _run_config(n, decode + SPLIT_TOKENS + 1)
            ids = _prompt_ids(model.config.vocab_size, n)
        else:
            config = policy_config(policy, policy_params or {}, decode + SPLIT_TOKENS + 1)
            ids = _text_ids(model, n)
        session = DecodeSession(model, "", config, prompt_ids=ids)
        session.request.ignore_eos = True  # a fixed number of tokens, as llama.cpp's loop decodes past its EOS
        session.record_cache = False  # as `run` without --trace
        begin = time.perf_counter()  # run's clock: from its loop's start to the first token
        # `run`'s progress hook (its bar drawn only on a terminal) stands for the hooks a front end adds
        session.add_hook(lambda record, s=session: (len(s.generated), record.kind, record.resident_tokens))
        stamps: list[float] = []
        cpu: list[float] = []  # the process's CPU seconds: what a step costs however many others share the cores
        kinds: list[str] = []
        session.add_hook(lambda record: (stamps.append(time.perf_counter()), cpu.append(time.process_time()),
                                         kinds.append(record.kind)))
        loop = session.run()
        while not session.generated:  # the prompt's prefill, to the first token (in chunks when the cache evicts)
            next(loop)
        first = len(stamps) - 1
        for _ in range(decode):
            next(loop)
        out[f"prefill_{n}"] = n / (stamps[first] - begin)
        out[f"decode_{n}"] = decode / (stamps[-1] - stamps[first])
        out[f"decode_cpu_{n}"] = decode / (cpu[-1] - cpu[first])  # tokens per CPU second
        out[f"timed_decode_steps_{n}"] = kinds[first + 1:].count("decode")  # all of them: no prompt chunk timed
        out[f"split_{n}"] = _engine_split(session, loop, stamps)
        out[f"peak_rss_{n}"] = _peak_rss()
        session.close()
    return out


def _engine_split(session, loop, stamps: list[float]) -> dict:
    """SPLIT_TOKENS more steps with every part timed: ms per token by part."""
    clock = _Clock()
    engine = session.engine
    attend, sample = engine._batched_attend, engine._sample
    engine._batched_attend = lambda segments: clock.wrap("attention", attend(segments))
    engine._sample = clock.wrap("sampling", sample)
    totals = {"forward": 0.0, "sample": 0.0, "oracle": 0.0, "record": 0.0, "total": 0.0}
    first = len(stamps)
    with _timed_products(clock):
        for _ in range(SPLIT_TOKENS):
            record = next(loop)
            for key in totals:
                totals[key] += record.timings.get(key, 0.0)
    engine._batched_attend, engine._sample = attend, sample
    wall = stamps[-1] - stamps[first - 1]
    parts = clock.seconds
    parts["forward_rest"] = totals["forward"] - parts["weights"] - parts["attention"]
    # the engine's step outside the forward and the sampling, and the session's between the step and its record
    parts["bookkeeping"] = totals["sample"] + totals["oracle"] - parts["sampling"]
    parts["record"] = totals["record"]
    parts["between"] = wall - totals["total"]
    return {"wall": 1e3 * wall / SPLIT_TOKENS, **{k: 1e3 * v / SPLIT_TOKENS for k, v in parts.items()}}


def model_worker(path: str, threads: int, decode: int, prompts=PROMPTS) -> dict:
    from pagevis.model import DenseAttention, load_model, set_blas_threads
    from pagevis.model.weight_threads import set_weight_threads

    set_blas_threads(1)
    set_weight_threads(threads)
    start = time.perf_counter()
    model = load_model(path)
    out = {"load_s": time.perf_counter() - start}
    for n in prompts:
        ids = _prompt_ids(model.config.vocab_size, n)
        attention = DenseAttention(model.config)
        begin = time.perf_counter()
        logits = model.forward(np.array(ids), np.arange(n), attention)
        out[f"prefill_{n}"] = n / (time.perf_counter() - begin)
        position = n
        begin = time.perf_counter()
        for _ in range(decode):
            logits = model.forward(np.array([int(np.argmax(logits))]), np.array([position]), attention)
            position += 1
        out[f"decode_{n}"] = decode / (time.perf_counter() - begin)
        clock = _Clock()
        attend = clock.wrap("attention", attention)
        with _timed_products(clock):
            begin = time.perf_counter()
            for _ in range(SPLIT_TOKENS):
                logits = model.forward(np.array([int(np.argmax(logits))]), np.array([position]), attend)
                position += 1
            wall = time.perf_counter() - begin
        parts = clock.seconds
        parts["forward_rest"] = wall - parts["weights"] - parts["attention"]
        out[f"split_{n}"] = {"wall": 1e3 * wall / SPLIT_TOKENS, **{k: 1e3 * v / SPLIT_TOKENS for k, v in parts.items()}}
        out[f"peak_rss_{n}"] = _peak_rss()
        del attention, attend
    return out


WORKERS = {"engine": engine_worker, "model": model_worker, "llama.cpp": llama_cpp_worker}


def run_worker(config: dict, path: str, decode: int, prompts, timeout: float = 1200) -> dict:
    """One configuration in a fresh process; its measurements (or {"error": ...})."""
    return weights.run_worker(config, path, decode, timeout, "pagevis.bench.engine", prompts=list(prompts))


def configurations(llama_cpp: bool, threads=(1, 2)) -> list[dict]:
    return [{"engine": e, "threads": t} for t in threads for e in ENGINES if e != "llama.cpp" or llama_cpp]


def _median_row(config: dict, results: list[dict]) -> dict:
    good = [r for r in results if "error" not in r]
    row = dict(config, name=f"{config['engine']} {config['threads']}t", runs=len(good), loads=[r.get("load")
                                                                                          for r in results])
    if not good:
        row["error"] = results[-1].get("error")
        return row
    for key in good[0]:
        if isinstance(good[0][key], (int, float)):
            row[key] = statistics.median(r[key] for r in good)
        elif key.startswith("split_"):
            row[key] = {part: statistics.median(r[key][part] for r in good) for part in good[0][key]}
    return row


def bench_model(label: str, path: str, rounds: int, decode: int, prompts, llama_cpp: bool, threads=(1, 2),
                say=print) -> dict:
    """Every configuration on one file, interleaved over `rounds`; per configuration the median of each number."""
    configs = configurations(llama_cpp, threads)
    runs: list[list[dict]] = [[] for _ in configs]
    for round_index in range(rounds):
        for index, config in enumerate(configs):
            say(f"  {label}: round {round_index + 1}/{rounds}, {config['engine']} {config['threads']}t")
            result = run_worker(config, path, decode, prompts)
            result["load"] = os.getloadavg()[0]
            runs[index].append(result)
    rows = [_median_row(config, results) for config, results in zip(configs, runs)]
    return {"model": label, "path": path, "rows": rows, "ratios": ratios(rows, prompts)}


def ratios(rows: list[dict], prompts=PROMPTS) -> dict:
    """engine over llama.cpp and over the bare model, at equal threads and prompt (decode, prefill, peak RSS, and the
    attention's ms a token over the dense attention's); 2 threads over 1."""
    by = {r["name"]: r for r in rows if "error" not in r}
    out = {}
    for t in (1, 2):
        engine, model, peer = by.get(f"engine {t}t"), by.get(f"model {t}t"), by.get(f"llama.cpp {t}t")
        for n in prompts:
            for key in (f"decode_{n}", f"prefill_{n}"):
                if engine and peer and key in engine and key in peer:
                    out[f"{key} engine/llama.cpp {t}t"] = engine[key] / peer[key]
                if engine and model and key in engine and key in model:
                    out[f"{key} engine/model {t}t"] = engine[key] / model[key]
            if engine and model and f"split_{n}" in engine and f"split_{n}" in model:
                # the paged decode attention (K/V written into pages, attended in place) over the dense one's
                out[f"attention_{n} engine/model {t}t"] = (engine[f"split_{n}"]["attention"]
                                                         / model[f"split_{n}"]["attention"])
            if engine and peer and f"peak_rss_{n}" in peer:
                out[f"peak_rss_{n} engine/llama.cpp {t}t"] = engine[f"peak_rss_{n}"] / peer[f"peak_rss_{n}"]
    for name in ENGINES:
        one, two = by.get(f"{name} 1t"), by.get(f"{name} 2t")
        for n in prompts:
            if one and two and f"decode_{n}" in one:
                out[f"decode_{n} {name} 2t/1t"] = two[f"decode_{n}"] / one[f"decode_{n}"]
    return out


def run_bench(rounds: int = 3, decode: int = 64, models: tuple[str, ...] = ("smollm2", "gemma3-270m"),
              prompts=PROMPTS, threads=(1, 2), say=print) -> dict:
    from pagevis.model.errors import ModelLoadError
    from pagevis.model.locate import named_model_path

    llama_cpp = llama_cpp_available()
    result = {"cpu": _cpu(), "load_before": os.getloadavg(), "llama_cpp": llama_cpp, "prompts": list(prompts),
              "decode_tokens": decode, "models": []}
    for name in models:
        try:
            path = str(named_model_path(name)) if not os.path.isfile(name) else name
        except ModelLoadError as error:
            say(f"  {name}: skipped ({error})")
            continue
        result["models"].append(bench_model(name, path, rounds, decode, prompts, llama_cpp, threads, say))
    result["load_after"] = os.getloadavg()
    return result


def run_policy_bench(rounds: int = 3, decode: int = 64, model: str = "smollm2", policies=TOKEN_POLICIES,
                     prompt: int = 512, say=print) -> dict:
    """Each policy's decode as `run --policy P --page-size 16 --max-pages 16` after a `prompt`-token text (every
    step evicts), one thread, each in its own process, rounds interleaved; its rate over sinks' in each round."""
    from pagevis.model.locate import named_model_path

    path = str(named_model_path(model)) if not os.path.isfile(model) else model
    policies = (plain("sinks"), *[p for p in policies if p.label != "sinks"])
    runs: dict[str, list[dict]] = {p.label: [] for p in policies}
    for round_index in range(rounds):
        for policy in policies:
            say(f"  {model}: round {round_index + 1}/{rounds}, {policy.label}")
            job = {"engine": "engine", "threads": 1, "policy": policy.name, "policy_params": policy.params}
            result = run_worker(job, path, decode, (prompt,))
            result["load"] = os.getloadavg()[0]
            runs[policy.label].append(result)
    rows = []
    for policy, results in runs.items():
        row = _median_row({"engine": "engine", "threads": 1}, results)
        row["name"] = policy
        # the ratio in each round (the same minutes' load on both), then their median; by the wall clock and by the
        # CPU time a token took (on a shared machine the wall clock's ratio moves with others' load)
        for key, clock in (("over_sinks", "decode"), ("over_sinks_cpu", "decode_cpu")):
            per_round = [r[f"{clock}_{prompt}"] / s[f"{clock}_{prompt}"] for r, s in zip(results, runs["sinks"])
                         if f"{clock}_{prompt}" in r and f"{clock}_{prompt}" in s]
            if per_round:
                row[key], row[f"{key}_rounds"] = statistics.median(per_round), per_round
        rows.append(row)
    return {"cpu": _cpu(), "model": model, "prompt": prompt, "pages": f"{POLICY_PAGES} x {PAGE_SIZE}",
            "decode_tokens": decode, "rounds": rounds, "rows": rows}


def format_policy_report(result: dict) -> str:
    n = result["prompt"]
    lines = [f"Each policy's decode, {result['model']}, pages of {result['pages']} after a {n}-token text (every "
             f"step evicts), one thread — {result['cpu']}; medians of {result['rounds']} interleaved rounds, "
             f"{result['decode_tokens']} tokens, tokens/s wall clock",
             f"  {'policy':20} {'decode':>8} {'/ sinks':>8}  {'per round':18} {'by CPU':>7}  {'per round':18} "
             f"{'load':>14}   ms a token: wall, attention, bookkeeping (scoring is in these two), weights"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"  {row['name']:20} error: {row['error']}")
            continue
        rounds = " ".join(f"{r:.2f}" for r in row.get("over_sinks_rounds", []))
        cpu = " ".join(f"{r:.2f}" for r in row.get("over_sinks_cpu_rounds", []))
        loads = " ".join(f"{load:.1f}" for load in row["loads"] if load is not None)
        split = row.get(f"split_{n}", {})
        parts = " ".join(f"{split.get(part, 0.0):6.2f}" for part in ("wall", "attention", "bookkeeping", "weights"))
        lines.append(f"  {row['name']:20} {row[f'decode_{n}']:8.1f} {row.get('over_sinks', 0.0):7.2f}x  {rounds:18} "
                     f"{row.get('over_sinks_cpu', 0.0):6.2f}x  {cpu:18} {loads:>14}   {parts}")
    return "\n".join(lines)


def format_report(result: dict) -> str:
    prompts = result["prompts"]
    lines = [f"pagevis run's decode (engine) beside the bare model and llama.cpp — {result['cpu']}, load "
             f"{result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after; medians of interleaved "
             f"rounds, {result['decode_tokens']} greedy tokens, tokens/s wall clock"]
    if not result["llama_cpp"]:
        lines.append("llama.cpp: not installed (pip install -e '.[bench]')")
    heads = "".join(f" {'dec@' + str(n):>8} {'pre@' + str(n):>8} {'RSS@' + str(n):>8}" for n in prompts)
    for model in result["models"]:
        lines += [f"\n{model['model']} ({Path(model['path']).name})", f"  {'':14}{heads}"]
        for row in model["rows"]:
            if "error" in row:
                lines.append(f"  {row['name']:14} error: {row['error']}")
                continue
            cells = "".join(f" {row[f'decode_{n}']:8.1f} {row[f'prefill_{n}']:8.1f} "
                            f"{row[f'peak_rss_{n}'] / 2**20:5.0f}MiB" for n in prompts)
            lines.append(f"  {row['name']:14}{cells}")
        lines.append("  ms per token (" + ", ".join(PARTS) + "; wall: all of it):")
        for row in model["rows"]:
            for n in prompts:
                split = row.get(f"split_{n}")
                if split:
                    parts = " ".join(f"{part} {split[part]:.2f}" for part in PARTS if split.get(part))
                    lines.append(f"    {row['name']:14} after {n:>4}: wall {split['wall']:.2f} = {parts}")
        for key, value in model["ratios"].items():
            lines.append(f"  {key}: {value:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pagevis.bench.engine")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    job = json.loads(args.worker)
    extra = {"policy": job["policy"], "policy_params": job.get("policy_params")} if job.get("policy") else {}
    out = WORKERS[job["engine"]](job["path"], job["threads"], job["decode"], tuple(job["prompts"]), **extra)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

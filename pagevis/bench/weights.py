"""`pagevis bench weights`: decoding with the weights as the GGUF stores them, beside the float32 path and llama.cpp.

Every configuration runs in its own process (so each has its own peak RSS), the configurations interleaved round by
round (so load from other processes falls on all alike), medians over the rounds. Per model file:
  pagevis --weights quantized on 1 and 2 threads, pagevis --weights float32 (its BLAS thread and measured plan, as
  before), llama.cpp (llama-cpp-python, the `bench` extra, when installed) on 1 and 2 threads;
each measures decode tokens/s after a 23-token prompt and after a 512-token prefill, prefill tokens/s of those
512 tokens, the process's peak RSS, and (pagevis) aggregate decode tokens/s of 8 and 16 sequences in one forward.
The quantized rows add the weight bytes read per token and the read floor: the tokens/s a read of those bytes at
the measured bandwidth allows. A synthetic Q4_K_M file of Llama 3.2 1B's shapes (random weights, written into a
temporary folder) gets the quantized rows too.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT_TOKENS = 23
PREFILL_TOKENS = 512
BATCHES = (8, 16)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resident() -> int:
    """The process's resident bytes now (Linux /proc; elsewhere the peak, which is all getrusage says)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return _peak_rss()


def _prompt_ids(vocab: int, n: int) -> list[int]:
    return [int(v) for v in (np.arange(n) * 7919 + 1009) % min(vocab - 256, 32000) + 256]  # in any vocabulary


def pagevis_worker(path: str, weights: str, threads: int, decode: int, batches: bool) -> dict:
    from pagevis.model import DenseAttention, load_model, set_blas_threads
    from pagevis.model.weight_threads import set_weight_threads

    set_blas_threads(1)
    set_weight_threads(threads)
    memory = {"imports": _resident()}
    if weights == "quantized":
        from pagevis.model.quantized import kernels

        kernels()  # load_model would load them too: here first, so their runtime's memory is told apart
        memory["kernels"] = _resident() - memory["imports"]
    start = time.perf_counter()
    model = load_model(path, weights=weights)
    out = {"load_s": time.perf_counter() - start, "weights": model.weight_info}
    if weights == "quantized":  # float32 weights are mapped from the weight cache: resident only once read
        memory["weights"] = model.weight_info["bytes"]
        memory["tokenizer_and_rest"] = _resident() - memory["imports"] - memory["kernels"] - memory["weights"]
        memory["load_peak"] = _peak_rss()
        out["memory"] = memory

    def greedy(logits, attention, position, steps) -> float:
        begin = time.perf_counter()
        for _ in range(steps):
            logits = model.forward(np.array([int(np.argmax(logits))]), np.array([position]), attention)
            position += 1
        return steps / (time.perf_counter() - begin)

    ids = _prompt_ids(model.config.vocab_size, PREFILL_TOKENS)
    attention = DenseAttention(model.config)
    logits = model.forward(np.array(ids[:PROMPT_TOKENS]), np.arange(PROMPT_TOKENS), attention)
    out["decode_23"] = greedy(logits, attention, PROMPT_TOKENS, decode)
    attention = DenseAttention(model.config)
    begin = time.perf_counter()
    logits = model.forward(np.array(ids), np.arange(PREFILL_TOKENS), attention)
    out["prefill_512"] = PREFILL_TOKENS / (time.perf_counter() - begin)
    out["decode_512"] = greedy(logits, attention, PREFILL_TOKENS, decode)
    out["peak_rss"] = _peak_rss()
    if weights == "quantized":
        from pagevis.bench.bandwidth import measure_read_bandwidth

        read = measure_read_bandwidth(model.weight_info["bytes"])["read"]
        out["read_gb_s"] = read / 1e9
        out["floor_tok_s"] = read / model.weight_info["bytes"]
        if threads == 1:
            from pagevis.bench.weight_types import read_rate, type_rates

            out["types"], out["core_read_gb_s"] = type_rates(model.weights), read_rate()
    if batches:
        from pagevis.bench.kernels import _decode_steps

        for m in BATCHES:
            wall, _ = _decode_steps(model, m, steps=4, prompt=16)
            out[f"batch_{m}"] = m / statistics.median(wall)
    return out


def llama_cpp_worker(path: str, threads: int, decode: int, prompts=(PROMPT_TOKENS, PREFILL_TOKENS)) -> dict:
    """llama.cpp (llama-cpp-python) on the same file: prefill each prompt, then decode greedily from the batch's
    last row, the only logits it computes (logits_all off); rates and the peak RSS after each prompt."""
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=max(prompts) + decode + 16, n_batch=max(prompts), n_threads=threads,
                n_threads_batch=threads, verbose=False)
    out = {"load_s": time.perf_counter() - start}
    for n in prompts:
        ids = _prompt_ids(llm.n_vocab(), n)
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{n}"] = n / (time.perf_counter() - begin)
        begin = time.perf_counter()
        for _ in range(decode):
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))])
        out[f"decode_{n}"] = decode / (time.perf_counter() - begin)
        out[f"peak_rss_{n}"] = _peak_rss()
    out["peak_rss"] = out[f"peak_rss_{max(prompts)}"]
    return out


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def configurations(llama_cpp: bool, float32: bool = True) -> list[dict]:
    rows = [{"engine": "pagevis", "weights": "quantized", "threads": t} for t in (1, 2)]
    if float32:
        rows.append({"engine": "pagevis", "weights": "float32", "threads": 1})
    if llama_cpp:
        rows += [{"engine": "llama.cpp", "threads": t} for t in (1, 2)]
    return rows


def run_worker(config: dict, path: str, decode: int, timeout: float = 900, module: str = "pagevis.bench.weights",
               **job_extra) -> dict:
    """One configuration in a fresh process (`python -m module --worker JOB`); its measurements (or {"error": ...})."""
    job = dict(config, path=path, decode=decode, **job_extra)
    try:
        done = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(job)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def bench_model(label: str, path: str, rounds: int, decode: int, llama_cpp: bool, float32: bool = True,
                say=print) -> dict:
    """Every configuration on one file, interleaved over `rounds`; per configuration the median of each number."""
    configs = configurations(llama_cpp, float32)
    runs: list[list[dict]] = [[] for _ in configs]
    for round_index in range(rounds):
        for index, config in enumerate(configs):
            say(f"  {label}: round {round_index + 1}/{rounds}, {_name(config)}")
            runs[index].append(run_worker(config, path, decode))
    rows = []
    for config, results in zip(configs, runs):
        good = [r for r in results if "error" not in r]
        row = dict(config, name=_name(config), runs=len(good))
        if not good:
            row["error"] = results[-1].get("error")
        else:
            keys = {k for r in good for k, v in r.items() if isinstance(v, (int, float))}
            row.update({k: statistics.median(r[k] for r in good if k in r) for k in sorted(keys)})
            row["weights_info"] = good[-1].get("weights")
            if all("types" in r for r in good):
                row["types"] = {label: {k: statistics.median(r["types"][label][k] for r in good) for k in entry}
                                for label, entry in good[0]["types"].items()}
            if all("memory" in r for r in good):
                row["memory"] = {k: statistics.median(r["memory"][k] for r in good) for k in good[0]["memory"]}
        rows.append(row)
    return {"model": label, "path": path, "rows": rows, "ratios": ratios(rows)}


def _name(config: dict) -> str:
    if config["engine"] == "llama.cpp":
        return f"llama.cpp {config['threads']}t"
    return f"pagevis {config['weights']} {config['threads']}t"


def ratios(rows: list[dict]) -> dict:
    """The targets' ratios: quantized over llama.cpp at equal threads, over float32, RSS and prefill."""
    by = {r["name"]: r for r in rows if "error" not in r}
    out = {}
    for t in (1, 2):
        q, peer = by.get(f"pagevis quantized {t}t"), by.get(f"llama.cpp {t}t")
        if q and peer:
            for key in ("decode_23", "decode_512", "prefill_512"):
                out[f"{key} vs llama.cpp {t}t"] = q[key] / peer[key]
            out[f"peak RSS vs llama.cpp {t}t"] = q["peak_rss"] / peer["peak_rss"]
    f32 = by.get("pagevis float32 1t")
    for t in (1, 2):
        q = by.get(f"pagevis quantized {t}t")
        if q and f32:
            out[f"decode_23 {t}t vs float32"] = q["decode_23"] / f32["decode_23"]
            for m in BATCHES:
                if f"batch_{m}" in q and f"batch_{m}" in f32:
                    out[f"batch_{m} {t}t vs float32"] = q[f"batch_{m}"] / f32[f"batch_{m}"]
    return out


def run_bench(rounds: int = 3, decode: int = 32, synthetic_1b: bool = True, models: tuple[str, ...] = (),
              say=print) -> dict:
    from pagevis.model.locate import named_model_path
    from pagevis.model.errors import ModelLoadError

    llama_cpp = llama_cpp_available()
    result = {"cpu": _cpu(), "load_before": os.getloadavg(), "llama_cpp": llama_cpp, "models": []}
    for name in models or ("smollm2", "gemma3-270m"):
        try:
            path = str(named_model_path(name))
        except ModelLoadError as error:
            say(f"  {name}: skipped ({error})")
            continue
        result["models"].append(bench_model(name, path, rounds, decode, llama_cpp, say=say))
    if synthetic_1b:
        from pagevis.bench.synthetic_gguf import write_q4_k_m_gguf

        with tempfile.TemporaryDirectory(prefix="pagevis-1b-") as folder:
            say("  writing the synthetic 1B Q4_K_M file")
            path = str(write_q4_k_m_gguf(Path(folder) / "llama-3.2-1b-shapes-q4_k_m.gguf"))
            result["models"].append(bench_model("synthetic 1B Q4_K_M", path, max(1, rounds - 1), min(decode, 16),
                                                llama_cpp, float32=False, say=say))
    result["load_after"] = os.getloadavg()
    return result


def _cpu() -> str:
    from pagevis.model.matmul import cpu_model

    return f"{cpu_model()} x{os.cpu_count()}"


def format_report(result: dict) -> str:
    lines = [f"Weights as the GGUF stores them vs float32 and llama.cpp — {result['cpu']}, load "
             f"{result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after (medians, interleaved)"]
    columns = ("decode_23", "decode_512", "prefill_512", "batch_8", "batch_16")
    for model in result["models"]:
        lines.append(f"\n{model['model']} ({Path(model['path']).name})")
        lines.append(f"  {'':24} {'dec@23':>8} {'dec@512':>8} {'prefill':>8} {'8 seqs':>8} {'16 seqs':>8} "
                     f"{'peak RSS':>9} {'load s':>7}")
        for row in model["rows"]:
            if "error" in row:
                lines.append(f"  {row['name']:24} error: {row['error']}")
                continue
            cells = " ".join(f"{row[c]:8.1f}" if c in row else f"{'-':>8}" for c in columns)
            lines.append(f"  {row['name']:24} {cells} {row['peak_rss'] / 2**20:6.0f} MiB {row['load_s']:7.1f}")
        quantized = next((r for r in model["rows"] if r.get("weights") == "quantized" and "floor_tok_s" in r), None)
        if quantized:
            info = quantized["weights_info"]
            lines.append(f"  weights {info['types']}: {info['bytes'] / 1e6:.0f} MB read per token; read floor "
                         f"{quantized['floor_tok_s']:.1f} tok/s at {quantized['read_gb_s']:.1f} GB/s (1 thread): "
                         f"decode at {quantized['decode_23'] / quantized['floor_tok_s']:.2f} of it")
        typed = next((r for r in model["rows"] if "types" in r), None)
        if typed:
            from pagevis.bench.weight_types import format_rates

            lines.append("  " + format_rates(typed["types"], typed.get("core_read_gb_s")))
        for row in model["rows"]:
            if "memory" in row:
                parts = ", ".join(f"{name.replace('_', ' ')} {row['memory'][name] / 2**20:.0f}" for name in
                                  ("imports", "kernels", "weights", "tokenizer_and_rest", "load_peak"))
                lines.append(f"  {row['name']} memory (MiB): {parts}")
        for key, value in model["ratios"].items():
            lines.append(f"  {key}: {value:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pagevis.bench.weights")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--no-1b", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        if job["engine"] == "llama.cpp":
            out = llama_cpp_worker(job["path"], job["threads"], job["decode"])
        else:
            out = pagevis_worker(job["path"], job["weights"], job["threads"], job["decode"],
                                 batches=job["threads"] == 1 or job["weights"] == "float32")
        print(json.dumps(out))
        return 0
    result = run_bench(args.rounds, args.decode_tokens, not args.no_1b, tuple(args.models.split(",")),
                       say=lambda text: print(text, file=sys.stderr))
    print(json.dumps(result) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

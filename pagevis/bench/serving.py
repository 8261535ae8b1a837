"""`pagevis bench serve`: the server under a chat workload, measured as its clients see it (vLLM's
benchmark_serving, in small).

The workload: chat requests whose system prompt is one of two shared ones (each over 150 tokens), asked by
users who come back: a user's second request carries its first exchange (question, the answer it streamed)
and a follow-up, so it shares even more with what the server has cached. Requests are sent at a fixed
concurrency (each of C clients runs users one after another: first turn, then the returning turn) or, with
`rates`, as Poisson arrivals at R requests/s (both: the concurrency levels, then the rates). Every request streams (stream_options.include_usage), decodes
max_tokens tokens (ignore_eos, so every level has the same shape), greedy.

Per level: request throughput, output tokens/s, the server process's CPU time per output token (every thread's:
a machine shared with other jobs delays the server without changing this much), time to first token (to the
first chunk with text), time per output token (per request: (end - first token) / (tokens - 1)) and
inter-token latency (every gap between text chunks), each as mean, p50 and p99; the prefix-cache hit rate (cached prompt tokens over prompt tokens,
from usage.prompt_tokens_details.cached_tokens) and the share of the system prompt that hit; /healthz latency
(probed every 50 ms while the level runs). The server is `pagevis serve` in its own process on a free loopback
port, warmed with one request per system prompt (their first requests, sent together so that they decode in one
batch) before the levels; with rounds > 1 the levels run again in turn, and 8 clients over 1 is of the medians.
Each level and round has users of its own (their reader numbers: Users), so what a level finds in the prefix cache
is what its own users share. The server's own account of each level, from its /metrics: its engine's steps by
their rows (decode only, prefill only, mixed), the seconds they took and the rows they fed (a decode step's mean
batch), the share of the level the engine spent in steps, and the mean queue time of a request.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pagevis.bench.serve import ServerProcess, loopback_client
from pagevis.bench.serving_workload import SYSTEM_PROMPTS, Users, first_turn
from pagevis.simserver.workload import PoissonGaps, returning_turn
from pagevis.token_times import TokenTimes

CONCURRENCIES = (1, 2, 4, 8, 16)
SERVER_FLAGS = ()  # serve's defaults: a full cache per request (policy none), pages of 16, a 4096-token pool
@dataclass
class Outcome:
    """One request as its client saw it (seconds from its start)."""

    system: int
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between text chunks
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish: str | None = None
    text: str = ""
    error: str = ""


def chat(client, model: str, messages: list[dict], max_tokens: int, system: int) -> Outcome:
    """Stream one chat request; what it took."""
    outcome = Outcome(system)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    times = TokenTimes()
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            outcome.status = answer.status_code
            if answer.status_code != 200:
                outcome.error = answer.read().decode(errors="replace")[:200]
                return outcome
            for line in answer.iter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                now = time.perf_counter() - started
                if payload.get("usage"):
                    usage = payload["usage"]
                    outcome.output_tokens = usage["completion_tokens"]
                    outcome.prompt_tokens = usage["prompt_tokens"]
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in payload.get("choices", ()):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        outcome.text += text
                        first, seconds = times.token(now)
                        if first:
                            outcome.ttft = seconds
                        else:
                            outcome.gaps.append(seconds)
                    outcome.finish = choice.get("finish_reason") or outcome.finish
    except Exception as error:  # noqa: BLE001 - counted as a failed request
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.e2e = time.perf_counter() - started
    return outcome


def at_concurrency(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, seed: int,
                   tag: str = "0") -> list:
    """C clients, each running users (first turn, then the returning one) until n_requests are sent."""
    users, outcomes, left = Users(seed, tag), [], [n_requests]
    lock = threading.Lock()

    def take() -> bool:
        with lock:
            left[0] -= 1
            return left[0] >= 0

    def client_loop() -> None:
        with loopback_client(url, 600) as client:
            while take():
                system, question, follow_up = users.next()
                first = chat(client, model, first_turn(system, question), max_tokens, system)
                with lock:
                    outcomes.append(first)
                if first.status != 200 or not take():
                    continue
                again = chat(client, model, returning_turn(first_turn(system, question), first.text, follow_up),
                             max_tokens, system)
                with lock:
                    outcomes.append(again)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def at_rate(url: str, model: str, rate: float, n_requests: int, max_tokens: int, seed: int, tag: str = "0") -> list:
    """Poisson arrivals at `rate` requests/s: each a new user's first turn, or (half the time, when one is
    waiting) a returning user's next turn."""
    users, rng, gaps = Users(seed, tag), random.Random(seed + 1), PoissonGaps(seed)
    outcomes, returning, threads = [], [], []
    lock = threading.Lock()

    def send(messages, system, user) -> None:
        with loopback_client(url, 600) as client:
            outcome = chat(client, model, messages, max_tokens, system)
        with lock:
            outcomes.append(outcome)
            if user is not None and outcome.status == 200:
                returning.append((*user, outcome.text))

    for _ in range(n_requests):
        with lock:
            back = returning.pop(0) if returning and rng.random() < 0.5 else None
        if back is not None:
            system, question, follow_up, answer = back
            args = (returning_turn(first_turn(system, question), answer, follow_up), system, None)
        else:
            system, question, follow_up = users.next()
            args = (first_turn(system, question), system, (system, question, follow_up))
        threads.append(threading.Thread(target=send, args=args))
        threads[-1].start()
        time.sleep(gaps.gap(60.0 * rate))
    for thread in threads:
        thread.join()
    return outcomes


def probe_health(url: str, stop: threading.Event, latencies: list[float]) -> None:

    with loopback_client(url, 30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz")
            latencies.append(time.perf_counter() - started)
            stop.wait(0.05)


def stats(values: list[float], scale: float = 1e3) -> dict:
    """mean, p50, p99 (in ms by default); None when there is nothing to measure."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    array = np.asarray(values) * scale
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99))}


def summarize(outcomes: list[Outcome], seconds: float, shared: list[int]) -> dict:
    ok = [o for o in outcomes if o.status == 200 and not o.error and o.finish]
    tokens = sum(o.output_tokens for o in ok)
    prompt = sum(o.prompt_tokens for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.ttft is not None and o.output_tokens > 1]
    system_hits = [min(o.cached_tokens, shared[o.system]) / shared[o.system] for o in ok]
    return {"requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
            "seconds": seconds, "request_throughput": len(ok) / seconds, "output_throughput": tokens / seconds,
            "output_tokens": tokens, "ttft_ms": stats([o.ttft for o in ok if o.ttft is not None]),
            "tpot_ms": stats(tpot), "itl_ms": stats([g for o in ok for g in o.gaps]),
            "prefix_hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else None,
            "system_prompt_hit": float(np.mean(system_hits)) if system_hits else None,
            "system_prompt_hit_min": float(np.min(system_hits)) if system_hits else None,
            "errors": sorted({o.error for o in outcomes if o.error})[:3]}


def shared_tokens(tokenizer) -> list[int]:
    """Per system prompt, the tokens every request with it shares (the longest common prefix of two of them)."""
    out = []
    for system in range(len(SYSTEM_PROMPTS)):
        a, b = (tokenizer.encode_chat(first_turn(system, q)) for q in ("Why?", "How?"))
        out.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
    return out


def run(model: str = "smollm2", concurrencies=CONCURRENCIES, rates=None, num_prompts: int | None = None,
        max_tokens: int = 32, seed: int = 0, flags: tuple[str, ...] = SERVER_FLAGS, progress=None,
        rounds: int = 1, bare: bool = True, int8_rows: str | None = None, dtype: str | None = None) -> dict:
    """Every level against one server process, the levels repeated `rounds` times in turn (so load from
    elsewhere hits each alike); the result (levels, system prompt sizes, 8 clients over 1). bare (when the levels
    hold 1 and 8 clients): after each round, the same kind of requests from 1 and 8 clients in the bare engine in
    this process (serving_bare.py), and the server's c8/c1 over the engine's. int8_rows, dtype: the server's and that
    engine's --int8-rows and --dtype (None: serve's defaults)."""
    from pagevis.bench import serving_bare
    from pagevis.engine import ModelSpec
    from pagevis.serve.app import model_id

    spec = ModelSpec(kind=model)
    loaded = spec.load()
    tokenizer = loaded.tokenizer
    bare = bare and all(c in (concurrencies or ()) for c in serving_bare.BARE_LEVELS)
    shared = shared_tokens(tokenizer)
    name = model_id(spec)
    flags = tuple(flags) + (() if int8_rows is None else ("--int8-rows", int8_rows)) + (
        () if dtype is None else ("--dtype", dtype))
    result = {"model": spec.label, "max_tokens": max_tokens, "server_flags": list(flags), "cpu_count": os.cpu_count(),
              "system_prompt_tokens": shared, "rounds": rounds, "levels": []}
    clients = serving_bare.BareClients(loaded, max_tokens, seed, int8_rows, dtype) if bare else None
    with ServerProcess(model, flags=flags) as server:
        warm_up(server.url, name)
        levels = [("concurrency", c) for c in concurrencies or ()] + [("rate", r) for r in rates or ()]
        for index in range(rounds):  # each round and level its own users (their reader numbers: Users)
            for number, (kind, value) in enumerate(levels):
                level = _level(server, name, kind, value, num_prompts, max_tokens, seed + index, shared,
                               f"{index + 1}.{number + 1}")
                result["levels"].append(level)
                if progress is not None:
                    progress(format_level(level))
            for count in serving_bare.BARE_LEVELS if clients is not None else ():  # the server idles meanwhile
                tag = next(f"{index + 1}.{number + 1}" for number, level in enumerate(levels) if level == ("concurrency", count))
                alone = clients.level(count, tag, index)  # the very requests that level's users sent the server
                result.setdefault("bare_levels", []).append(alone)
                if progress is not None:
                    progress(serving_bare.format_bare(alone))
    result.update(eight_over_one(result["levels"]))
    if clients is not None:
        result.update(serving_bare.bare_over(result["bare_levels"], result))
    return result


def warm_up(url: str, name: str) -> None:
    """The first request of each system prompt (a miss), sent at once so that they also decode together: the
    kernels of a batched step (loaded on its first use, ~1 s) are in before the levels, not inside the first one
    with more than one client."""
    warm: list[Outcome] = []

    def send(system: int) -> None:
        with loopback_client(url, 600) as client:
            warm.append(chat(client, name, first_turn(system, "Hello?"), 4, system))

    threads = [threading.Thread(target=send, args=(system,)) for system in range(len(SYSTEM_PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outcome in warm:
        if outcome.status != 200:
            raise RuntimeError(f"the server refused the warm-up request: {outcome.status} {outcome.error}")


def _level(server, name: str, kind: str, value, num_prompts, max_tokens: int, seed: int, shared,
           tag: str = "0") -> dict:
    """One level against the running server: what its clients saw, /healthz meanwhile, the server process's
    CPU time (every thread's; the /healthz probes' included) per output token, and its engine's steps (`steps`)."""
    n = num_prompts or max(4, 2 * int(value if kind == "concurrency" else 8))
    latencies: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe_health, args=(server.url, stop, latencies))
    load = os.getloadavg()[0]
    counted = engine_counters(server.url)
    prober.start()
    cpu, started = server.cpu_seconds(), time.perf_counter()
    if kind == "concurrency":
        outcomes = at_concurrency(server.url, name, int(value), n, max_tokens, seed, tag)
    else:
        outcomes = at_rate(server.url, name, float(value), n, max_tokens, seed, tag)
    seconds = time.perf_counter() - started
    cpu = None if cpu is None else server.cpu_seconds() - cpu
    steps = engine_steps(counted, engine_counters(server.url), seconds)
    stop.set()
    prober.join()
    level = {kind: value, "load_average": load, **summarize(outcomes, seconds, shared), "healthz_ms": stats(latencies),
             "server_cpu_s": cpu, "steps": steps}
    level["cpu_ms_per_token"] = 1e3 * cpu / level["output_tokens"] if cpu is not None and level["output_tokens"] else None
    return level


STEP_FAMILIES = ("pagevis_engine_step_seconds", "pagevis_iteration_tokens", "pagevis_request_queue_time_seconds")


def engine_counters(url: str) -> dict[str, float]:
    """The server's step histograms' counts and sums (by the steps' mix) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with loopback_client(url, 30) as client:
        text = client.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in STEP_FAMILIES:
            for sample in family.samples:
                if sample.name.endswith(("_count", "_sum")):
                    out[sample.name + "/" + sample.labels.get("mix", "")] = sample.value
    return out


def engine_steps(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """What the engine did in a level, from two scrapes of its counters: steps by mix (decode rows only, prompt rows
    only, both), the seconds they took and the rows they fed; the share of the level's wall time the engine was in
    a step (the rest: idle, or between steps); the mean decode step's rows; the mean queue time of a request."""
    def delta(name: str, mix: str = "") -> float:
        return after.get(f"{name}/{mix}", 0.0) - before.get(f"{name}/{mix}", 0.0)

    mixes = ("decode", "prefill", "mixed")
    steps = {mix: int(delta("pagevis_engine_step_seconds_count", mix)) for mix in mixes}
    busy = {mix: delta("pagevis_engine_step_seconds_sum", mix) for mix in mixes}
    rows = {mix: int(delta("pagevis_iteration_tokens_sum", mix)) for mix in mixes}
    queued = delta("pagevis_request_queue_time_seconds_count")
    return {"steps": steps, "seconds": busy, "rows": rows, "busy_share": sum(busy.values()) / seconds,
            "decode_rows_per_step": rows["decode"] / steps["decode"] if steps["decode"] else None,
            "queue_ms": 1e3 * delta("pagevis_request_queue_time_seconds_sum") / queued if queued else None}


def eight_over_one(levels: list[dict]) -> dict:
    """8 clients' output tokens/s over one client's (medians over the rounds), by wall clock and by the server's
    CPU time per token (which a machine shared with other jobs disturbs less)."""
    def median(concurrency: int, key: str) -> float | None:
        values = [level[key] for level in levels if level.get("concurrency") == concurrency and level[key] is not None]
        return float(np.median(values)) if values else None

    out = {}
    one, eight = median(1, "output_throughput"), median(8, "output_throughput")
    if one and eight:
        out["c8_over_c1"] = eight / one
    one, eight = median(1, "cpu_ms_per_token"), median(8, "cpu_ms_per_token")
    if one and eight:
        out["c8_over_c1_cpu"] = one / eight
    return out


HEADER = ("level", "req", "ok", "req/s", "out tok/s", "CPU ms/tok", "TTFT mean/p50/p99 ms", "TPOT mean/p50/p99 ms",
          "ITL mean/p50/p99 ms", "hit %", "sys hit %", "steps dec/mix/pre", "s dec/mix/pre", "rows/dec",
          "busy %", "queue ms", "healthz p99", "load")


def _triple(values: dict) -> str:
    return "/".join("-" if values[k] is None else f"{values[k]:.0f}" for k in ("mean", "p50", "p99"))


def format_level(level: dict) -> str:
    name = f"c={level['concurrency']}" if "concurrency" in level else f"{level['rate']:g}/s"
    hit = "-" if level["prefix_hit_rate"] is None else f"{100 * level['prefix_hit_rate']:.1f}"
    system = "-" if level["system_prompt_hit"] is None else f"{100 * level['system_prompt_hit']:.1f}"
    health = level["healthz_ms"]["p99"]
    cpu = level.get("cpu_ms_per_token")
    cells = (name, str(level["requests"]), str(level["completed"]), f"{level['request_throughput']:.2f}",
             f"{level['output_throughput']:.1f}", "-" if cpu is None else f"{cpu:.2f}", _triple(level["ttft_ms"]), _triple(level["tpot_ms"]),
             _triple(level["itl_ms"]), hit, system, *_step_cells(level.get("steps")),
             "-" if health is None else f"{health:.0f} ms", f"{level['load_average']:.1f}")
    return "  ".join(c.rjust(len(h)) for c, h in zip(cells, HEADER))


def _step_cells(steps: dict | None) -> tuple[str, ...]:
    """The engine's steps in a level: counts and seconds by mix, a decode step's rows, busy %, queue ms."""
    if not steps:
        return ("-",) * 5
    mixes = ("decode", "mixed", "prefill")
    rows, queue = steps["decode_rows_per_step"], steps["queue_ms"]
    return ("/".join(str(steps["steps"][m]) for m in mixes), "/".join(f"{steps['seconds'][m]:.2f}" for m in mixes),
            "-" if rows is None else f"{rows:.2f}", f"{100 * steps['busy_share']:.0f}",
            "-" if queue is None else f"{queue:.0f}")


def format_table(result: dict) -> str:
    lines = [f"pagevis bench serve: {result['model']}, {result['max_tokens']} output tokens per request (ignore_eos), "
             f"greedy, streamed chat; system prompts of {' and '.join(map(str, result['system_prompt_tokens']))} "
             f"shared tokens; server flags {' '.join(result['server_flags']) or 'none (its defaults)'}; "
             f"{result['cpu_count']} cores",
             "  ".join(HEADER)]
    lines += [format_level(level) for level in result["levels"]]
    if "c8_over_c1" in result:
        rounds = f" (medians of {result['rounds']} rounds)" if result.get("rounds", 1) > 1 else ""
        cpu = (f"; by the server's CPU time per token {result['c8_over_c1_cpu']:.2f}x" if "c8_over_c1_cpu" in result
               else "")
        lines.append(f"output tokens/s at 8 clients = {result['c8_over_c1']:.2f}x one client by wall clock{cpu}"
                     f"{rounds} (target >= 3.5)")
    if "bare_c8_over_c1" in result:
        from pagevis.bench.serving_bare import format_bare

        lines += [format_bare(level) for level in result["bare_levels"]]
        served = result.get("served_over_bare")
        lines.append(f"the engine alone on the same kind of requests: 8 clients = {result['bare_c8_over_c1']:.2f}x one"
                     + ("" if served is None else f"; the server's ratio is {served:.2f} of it"))
    rates = [level["prefix_hit_rate"] for level in result["levels"] if level["prefix_hit_rate"] is not None]
    if rates:
        lines.append(f"prompt tokens from the prefix cache: {100 * min(rates):.1f}-{100 * max(rates):.1f}% per level")
    hits = [level["system_prompt_hit_min"] for level in result["levels"] if level["system_prompt_hit_min"] is not None]
    if hits:
        lines.append(f"system prompt tokens from the prefix cache after its first request: at least {100 * min(hits):.1f}% "
                     "in every request (target >= 90%)")
    sixteen = next((level for level in result["levels"] if level.get("concurrency") == 16), None)
    if sixteen is not None and sixteen["healthz_ms"]["p99"] is not None:
        lines.append(f"/healthz p99 while 16 clients stream: {sixteen['healthz_ms']['p99']:.0f} ms (target <= 100)")
    return "\n".join(lines)


def plot(result: dict, folder: str, line_plot) -> list[str]:
    """bench-serve.png: output tokens/s, and TTFT and ITL p50, against the level (the concurrency levels, or
    else the rates)."""
    key = "concurrency" if "concurrency" in result["levels"][0] else "rate"
    levels = [level for level in result["levels"] if key in level]
    xs = [level[key] for level in levels]
    throughput = {"output tokens/s": (xs, [level["output_throughput"] for level in levels])}
    latency = {f"{name} p50": (xs, [level[f"{name.lower()}_ms"]["p50"] for level in levels])
               for name in ("TTFT", "ITL", "TPOT")}
    label = "concurrent clients" if key == "concurrency" else "requests/s (Poisson)"
    paths = [line_plot(os.path.join(folder, "bench-serve.png"), throughput,
                       f"pagevis serve, {result['model']}: output tokens/s", label, "tokens/s", log_x=True,
                       x_ticks=xs),
             line_plot(os.path.join(folder, "bench-serve-latency.png"), latency,
                       f"pagevis serve, {result['model']}: latency p50", label, "ms", log_x=True, log_y=True,
                       x_ticks=xs)]
    return paths

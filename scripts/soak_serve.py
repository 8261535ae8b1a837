"""Soak `pagevis serve`: a mixed load for a while, the server's RSS sampled throughout (`make soak`).

    python scripts/soak_serve.py [--minutes 10] [--model smollm2|synthetic] [--clients 8]

The load, from `--clients` threads: streamed chat requests on the serving benchmark's shared system prompts
(a quarter of them dropped after a few chunks), now and then n = 3 samples, a /v1/sessions session stepped
a few times and deleted, and a malformed request. The server's RSS (VmRSS of its process) is read every 5
seconds; after the warm-up (the first fifth of the run) it must stay within 10% of its value at the end of
the warm-up. Prints the samples' summary and exits 1 if RSS grew more, or if any answer was a 5xx.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

import httpx

from pagevis.bench.serve import ServerProcess
from pagevis.bench.serving_workload import FOLLOW_UPS, QUESTIONS, SYSTEM_PROMPTS, first_turn
from pagevis.simserver.workload import returning_turn


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def client_loop(url: str, model: str, seed: int, stop: threading.Event, counts: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        while not stop.is_set():
            roll = rng.random()
            system = rng.randrange(len(SYSTEM_PROMPTS))
            messages = first_turn(system, rng.choice(QUESTIONS))
            if rng.random() < 0.3:
                messages = returning_turn(system, messages[1]["content"], "I am not sure.", rng.choice(FOLLOW_UPS))
            try:
                if roll < 0.05:
                    answer = client.post("/v1/chat/completions", json={"model": model, "messages": []})
                    status = answer.status_code
                elif roll < 0.12:
                    answer = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "n": 3,
                                                                       "max_tokens": 8, "temperature": 0.8})
                    status = answer.status_code
                elif roll < 0.18:
                    created = client.post("/v1/sessions", json={"prompt": messages[1]["content"], "max_tokens": 12,
                                                                "record_layers": "none"})
                    status = created.status_code
                    if status == 201:
                        sid = created.json()["id"]
                        for _ in range(3):
                            status = max(status, client.post(f"/v1/sessions/{sid}/step", json={"n": 2}).status_code)
                        client.delete(f"/v1/sessions/{sid}")
                else:
                    body = {"model": model, "messages": messages, "max_tokens": rng.randint(4, 40), "stream": True,
                            "temperature": 0 if rng.random() < 0.5 else 0.9}
                    leave = rng.random() < 0.25
                    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                        status = answer.status_code
                        for i, _line in enumerate(answer.iter_lines()):
                            if leave and i >= 3:
                                break
            except httpx.HTTPError:
                status = -1
            with lock:
                counts[status] = counts.get(status, 0) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "synthetic"))
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)
    model = "SmolLM2-135M-Instruct" if args.model == "smollm2" else "synthetic"
    stop, lock, counts = threading.Event(), threading.Lock(), {}
    samples: list[tuple[float, float]] = []
    with ServerProcess(args.model) as server:
        pid = server.process.pid
        threads = [threading.Thread(target=client_loop, args=(server.url, model, i, stop, counts, lock))
                   for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        end = started + 60 * args.minutes
        while time.monotonic() < end:
            samples.append((time.monotonic() - started, rss_mib(pid)))
            time.sleep(5)
        stop.set()
        for thread in threads:
            thread.join(120)
        health = httpx.get(server.url + "/healthz", timeout=10).json()
        samples.append((time.monotonic() - started, rss_mib(pid)))
    warm = [s for s in samples if s[0] >= 60 * args.minutes / 5]
    base = warm[0][1]
    peak = max(r for _, r in warm)
    growth = peak / base - 1
    errors = sum(n for status, n in counts.items() if status >= 500 or status < 0)
    print(f"soak: {args.minutes:g} min, {args.model}, {args.clients} clients; answers by status {dict(sorted(counts.items()))}")
    print(f"RSS MiB: start {samples[0][1]:.0f}, after warm-up ({warm[0][0]:.0f} s) {base:.0f}, peak after it {peak:.0f} "
          f"({100 * growth:+.1f}%, limit +10%), end {samples[-1][1]:.0f}")
    print(f"afterwards: running {health['running']}, waiting {health['waiting']}, in flight {health['in_flight']}, "
          f"sessions {health['sessions']}")
    return 0 if growth <= 0.10 and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

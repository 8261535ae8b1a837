"""The matrix-vector kernels per ggml type: the bytes each type's matrices hold (what a decode step reads of them)
over the time their products take, in GB/s, beside a plain read of memory (`pagevis bench weights` prints it).

Every packed matrix of a loaded model (each layer's Q/K/V, output, gate/up and down parts, and the logits' matrix,
counted apart: the tied embedding is the biggest single product) is multiplied by one random row, on the calling
thread; each product's time is the median over `reps` passes over all of them, in the thread's CPU time (a process
waiting for a core on a busy machine is not counted as slow kernels; a core's cache or memory shared with other
processes still is). The read row: the best of a few passes of a numba loop reading a 256 MB array, the same
clock — what one core can read, the kernels' ceiling (a float32 gemv, the bandwidth bench's, reads slower).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

READ_BYTES = 256 << 20


def packed_matrices(weights) -> list[tuple[str, object]]:
    """(type label, matrix) for every packed matrix the decode products use; the output's labelled '(logits)'."""
    from pagevis.model.quantized import QuantMatrix

    found = []
    for layer in weights.layers:
        for operand in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            found += [(part.kind.name, part) for part in getattr(operand, "parts", [operand])
                      if isinstance(part, QuantMatrix)]
    if isinstance(weights.output_t, QuantMatrix):
        found.append((f"{weights.output_t.kind.name} (logits)", weights.output_t))
    return found


def type_rates(weights, reps: int = 5, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per type label: bytes held, MB, ms of its products per token (the sum of medians), GB/s."""
    from pagevis.model.weight_threads import set_weight_threads, weight_threads

    matrices = packed_matrices(weights)
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(m.n_in).astype(np.float32) for _, m in matrices]
    threads = weight_threads()
    set_weight_threads(1)  # the kernels' rate: one thread, the split measured by the decode rows
    try:
        times: list[list[float]] = [[] for _ in matrices]
        for _ in range(reps + 1):  # the first pass warms (and is dropped)
            for spent, (_, matrix), x in zip(times, matrices, rows):
                start = time.thread_time()
                matrix.product(x)
                spent.append(time.thread_time() - start)
    finally:
        set_weight_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for (label, matrix), spent in zip(matrices, times):
        entry = out.setdefault(label, {"bytes": 0, "ms": 0.0})
        entry["bytes"] += matrix.nbytes
        entry["ms"] += statistics.median(spent[1:]) * 1e3
    for entry in out.values():
        entry["mb"] = entry["bytes"] / 1e6
        entry["gb_s"] = entry["mb"] / entry["ms"] if entry["ms"] > 0 else float("nan")
    return out


def read_rate(nbytes: int = READ_BYTES, passes: int = 3) -> float:
    """GB/s one thread reads (an XOR over int64 words: no arithmetic to wait for), best of passes, CPU time."""
    from numba import njit

    @njit("int64(int64[::1])", nogil=True, cache=False)
    def xor_all(words):
        total = np.int64(0)
        for i in range(words.size):
            total ^= words[i]
        return total

    words = np.ones(nbytes // 8, np.int64)
    xor_all(words)
    best = np.inf
    for _ in range(passes):
        start = time.thread_time()
        xor_all(words)
        best = min(best, time.thread_time() - start)
    return nbytes / best / 1e9


def format_rates(rates: dict[str, dict[str, float]], read_gb_s: float | None = None) -> str:
    cells = "; ".join(f"{label} {e['mb']:.0f} MB {e['ms']:.2f} ms {e['gb_s']:.1f} GB/s" for label, e in rates.items())
    total = sum(e["ms"] for e in rates.values())
    read = f" (one core reads {read_gb_s:.1f} GB/s)" if read_gb_s else ""
    return f"kernels by type, 1 thread, CPU time{read}: {cells}; all {total:.2f} ms"

"""x @ W for the forward pass: one BLAS gemm for many rows, a blocked small-batch product for a few.

A decode step of m sequences multiplies m rows by every weight matrix. Memory traffic is the same for any
m (every weight is read once), so m rows should cost little more than one. OpenBLAS's sgemm does not see it
that way: for m = 2..16 it packs the whole weight first (measured on the 113 MB output projection: m = 1,
a gemv, 6-7 ms; m = 2..8 through sgemm, 31-40 ms).

Layout. Every weight matrix is stored output-major, an (out, in) C-contiguous array (the GGUF orientation),
and handed around as its (in, out) transposed view, so `x @ w` reads as usual. A run of output columns is
then one contiguous slab of rows, so the matrix can be viewed as (out // block, block, in) for any block that
divides out, without a copy, and `np.matmul` loops over the blocks in C: each block is read from memory once
and used for all m rows while it is in cache. The gemm path (`x @ w`: BLAS with a transposed operand) reads
the same array, so no weight is stored twice.

Which kernel for which m is measured, per weight shape (`calibrate`): a block size and an order (`xw`:
x @ block.T per block, `wx`: block @ x.T per block) or plain gemm. See docs/model.md for the figures.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import numpy as np

from pagevis.kernel_loader import cache_dir  # (where every cache of pagevis lives; imported from here too)
from pagevis.model.blas_threads import blas_description

ORDERS = ("xw", "wx")
BLOCKS = (32, 64, 96, 128, 192, 256, 384, 512)  # candidate block widths (output columns)
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # row counts calibrated; m between two uses the larger's kernel
SAMPLE_BYTES = 16 << 20  # weights timed per shape: well past L2, so blocks come from memory as in a step
PLAN_VERSION = 2  # 2: each shape's entry says when it was measured and how busy the machine was
BUSY_SHARE = 0.25  # others' share of the CPUs above which a measurement counts as taken under load


@dataclass(frozen=True)
class Kernel:
    """How to compute x @ w: one BLAS gemm over the whole matrix (block 0), or `block` output columns
    at a time in the given order."""

    block: int = 0
    order: str = "xw"

    def __str__(self) -> str:
        return "gemm" if self.block == 0 else f"{self.order}{self.block}"

    @classmethod
    def parse(cls, text: str) -> Kernel:
        if text == "gemm":
            return GEMM
        order, block = text[:2], int(text[2:])
        if order not in ORDERS or block <= 0:
            raise ValueError(f"not a kernel: {text!r}")
        return cls(block, order)


GEMM = Kernel()


def product(x: np.ndarray, w: np.ndarray, kernel: Kernel = GEMM) -> np.ndarray:
    """x (m, in) @ w (in, out) as float32 (m, out), with the given kernel. A blocked kernel needs w to be
    the transposed view of an (out, in) C-contiguous array and its block to divide out; otherwise gemm."""
    n_in, n_out = w.shape
    block = kernel.block
    if block == 0 or n_out % block or not w.T.flags.c_contiguous or x.ndim != 2:
        return x @ w
    blocks = w.T.reshape(n_out // block, block, n_in)  # a view: no copy
    m = len(x)
    out = np.empty((m, n_out), dtype=np.result_type(x, w))
    if kernel.order == "xw":  # (m, in) @ (in, block) per block, written in place: (blocks, m, block) view
        np.matmul(x, blocks.transpose(0, 2, 1), out=out.reshape(m, -1, block).transpose(1, 0, 2))
    else:  # (block, in) @ (in, m) per block: (blocks, block, m), then transposed into out
        out[...] = np.matmul(blocks, x.T).reshape(n_out, m).T
    return out


@dataclass(frozen=True)
class MatmulPlan:
    """Per weight shape (in, out): (rows, kernel) pairs sorted by rows; m rows use the kernel of the first
    pair with rows >= m, and gemm past the last. Shapes not listed always use gemm."""

    table: dict[tuple[int, int], tuple[tuple[int, Kernel], ...]]
    # per shape: {"at": ISO time of the measurement, "others_busy": the other processes' share of the CPUs then}
    measured: dict[tuple[int, int], dict] = field(default_factory=dict, compare=False)

    def kernel(self, shape: tuple[int, int], m: int) -> Kernel:
        for rows, kernel in self.table.get(shape, ()):
            if m <= rows:
                return kernel
        return GEMM

    def crossover(self, shape: tuple[int, int]) -> int | None:
        """The fewest rows for which this shape uses gemm (None: gemm only past the calibrated rows)."""
        return next((rows for rows, kernel in self.table.get(shape, ()) if kernel == GEMM), None)

    def to_json(self) -> dict:
        return {f"{n_in}x{n_out}": [[rows, str(kernel)] for rows, kernel in entries]
                for (n_in, n_out), entries in self.table.items()}

    @classmethod
    def from_json(cls, data: dict) -> MatmulPlan:
        table = {}
        for key, entries in data.items():
            n_in, n_out = (int(v) for v in key.split("x"))
            table[(n_in, n_out)] = tuple((int(rows), Kernel.parse(text)) for rows, text in entries)
        return cls(table)

    def describe(self) -> list[str]:
        """One line per shape: its kernel at each calibrated row count, and when it was measured."""
        return [f"{n_in}x{n_out}: " + " ".join(f"{rows}:{kernel}" for rows, kernel in entries)
                + _provenance(self.measured.get((n_in, n_out)))
                for (n_in, n_out), entries in self.table.items()]

    def under_load(self) -> list[tuple[int, int]]:
        """The shapes whose kernels were measured while other processes held more than BUSY_SHARE of the CPUs."""
        return [shape for shape, info in self.measured.items() if (info.get("others_busy") or 0) > BUSY_SHARE]


def _provenance(info: dict | None) -> str:
    if not info:
        return ""
    busy = info.get("others_busy")
    load = "" if busy is None else f", others busy {busy:.0%}" + (" (under load)" if busy > BUSY_SHARE else "")
    return f"  [measured {info.get('at', '?')}{load}]"


class CpuWatch:
    """The share of all CPUs that other processes used while the block ran (from /proc/stat and this process's
    own CPU time); None where /proc/stat is missing. A plan measured while others were busy is not trusted."""

    def __enter__(self) -> CpuWatch:
        self.share: float | None = None
        self._start = (_busy_seconds(), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = _busy_seconds(), _own_seconds(), time.perf_counter()
        if busy is None or self._start[0] is None:
            return
        elapsed = max(wall - self._start[2], 1e-6)
        others = (busy - self._start[0]) - (own - self._start[1])
        self.share = min(1.0, max(0.0, others / (elapsed * (os.cpu_count() or 1))))


def _busy_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in (fields + ["0"] * 8)[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def others_busy_now(seconds: float = 0.2) -> float | None:
    """Others' share of the CPUs over a short idle wait: is the machine quiet enough to measure?"""
    with CpuWatch() as watch:
        time.sleep(seconds)
    return watch.share


GEMM_ONLY = MatmulPlan({})


def matmul(x: np.ndarray, w: np.ndarray, plan: MatmulPlan = GEMM_ONLY) -> np.ndarray:
    """x @ w with the plan's kernel for this shape and number of rows."""
    return product(x, w, plan.kernel(w.shape, len(x)))


def candidates(n_out: int, blocks: Iterable[int] = BLOCKS) -> list[Kernel]:
    """gemm and every blocked kernel whose block divides n_out (and is smaller than it)."""
    return [GEMM] + [Kernel(b, order) for b in blocks if b < n_out and n_out % b == 0 for order in ORDERS]


def calibrate(samples: dict[tuple[int, int], list[np.ndarray]], rows: Iterable[int] = ROWS,
              blocks: Iterable[int] = BLOCKS, repeats: int = 3, seed: int = 0) -> MatmulPlan:
    """Time every candidate kernel on each shape's sample matrices (a pass over all of them, as a forward
    pass reads them) at each row count, and keep the fastest. Successive halving: every candidate is timed
    once, then the faster half again, until `repeats` rounds; a candidate's time is its best round."""
    rng = np.random.default_rng(seed)
    table, measured = {}, {}
    for shape, matrices in samples.items():
        kernels = candidates(shape[1], blocks)
        entries = []
        with CpuWatch() as watch:
            for m in rows:
                x = rng.standard_normal((m, shape[0])).astype(np.float32)
                entries.append((m, _fastest(kernels, x, matrices, repeats)))
        table[shape] = tuple(entries)
        measured[shape] = {"at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                           "others_busy": None if watch.share is None else round(watch.share, 3)}
    return MatmulPlan(table, measured)


def _fastest(kernels: list[Kernel], x: np.ndarray, matrices: list[np.ndarray], repeats: int) -> Kernel:
    best = {kernel: np.inf for kernel in kernels}
    alive = list(kernels)
    for _ in range(repeats):
        for kernel in alive:
            start = time.perf_counter()
            for w in matrices:
                product(x, w, kernel)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
        alive = sorted(alive, key=best.__getitem__)[:max(2, len(alive) // 2)]
    return min(kernels, key=best.__getitem__)


def sample_matrices(matrices: Iterable[np.ndarray], budget: int = SAMPLE_BYTES,
                    blocks: Iterable[int] = BLOCKS) -> dict[tuple[int, int], list[np.ndarray]]:
    """Group (in, out) weight views by shape, up to `budget` bytes per shape. A matrix larger than the
    budget is cut to its first output columns (a multiple of every candidate block that divides out, so the
    same kernels apply)."""
    samples: dict[tuple[int, int], list[np.ndarray]] = {}
    for w in matrices:
        group = samples.setdefault(w.shape, [])
        if sum(m.nbytes for m in group) >= budget:
            continue
        n_in, n_out = w.shape
        if w.nbytes > budget:
            step = int(np.lcm.reduce([b for b in blocks if b < n_out and n_out % b == 0] or [1]))
            columns = max(step, budget // (w.itemsize * n_in) // step * step)
            w = w.T[:columns].T
        group.append(w)
    return samples


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first), else what platform knows of it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def fingerprint() -> str:
    """What a measured plan depends on: the CPU, NumPy and its BLAS, and the BLAS thread count."""
    return f"v{PLAN_VERSION} | {cpu_model()} x{os.cpu_count()} | numpy {np.__version__} | {blas_description()}"


def plan_for(matrices: Iterable[np.ndarray], path: Path | None = None, remeasure: bool = False) -> MatmulPlan:
    """The plan for these weights on this machine: read from the cache file when it holds every shape
    for this fingerprint, else measured (about a second or two per shape) and written back. A shape measured
    under load is measured again once the machine is quiet; `remeasure` measures every shape again. An
    unreadable or unwritable cache only costs the measurement."""
    matrices = list(matrices)
    path = path or cache_dir() / "matmul-plans.json"
    key = fingerprint()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored = stored if isinstance(stored, dict) else {}
    known = stored.get(key, {}) if isinstance(stored.get(key), dict) else {}
    try:
        cached = _plan_from_store(known)
    except (ValueError, TypeError, AttributeError, KeyError):
        cached, known = MatmulPlan({}), {}
    shapes = {w.shape for w in matrices}
    wanted = shapes if remeasure else shapes - set(cached.table)
    noisy = set(cached.under_load()) & shapes
    if noisy and not remeasure and (others_busy_now() or 0) <= BUSY_SHARE:
        wanted |= noisy
    if not wanted:
        return _subplan(cached, shapes)
    fresh = calibrate(sample_matrices([w for w in matrices if w.shape in wanted]))
    plan = MatmulPlan({**cached.table, **fresh.table}, {**cached.measured, **fresh.measured})
    try:
        merged = {**known, **_store_of(fresh)}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({**stored, key: merged}, indent=1))
        temporary.replace(path)
    except OSError:
        pass
    return _subplan(plan, shapes)


def _subplan(plan: MatmulPlan, shapes: set[tuple[int, int]]) -> MatmulPlan:
    return MatmulPlan({s: plan.table[s] for s in shapes if s in plan.table},
                      {s: plan.measured[s] for s in shapes if s in plan.measured})


def _store_of(plan: MatmulPlan) -> dict:
    table = plan.to_json()
    return {f"{a}x{b}": {"kernels": table[f"{a}x{b}"], **plan.measured.get((a, b), {})} for a, b in plan.table}


def _plan_from_store(known: dict) -> MatmulPlan:
    plan = MatmulPlan.from_json({name: entry["kernels"] for name, entry in known.items()})
    measured = {}
    for name, entry in known.items():
        n_in, n_out = (int(v) for v in name.split("x"))
        measured[(n_in, n_out)] = {k: entry[k] for k in ("at", "others_busy") if k in entry}
    return MatmulPlan(plan.table, measured)

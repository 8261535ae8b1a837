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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from pagevis.model.blas_threads import blas_description

ORDERS = ("xw", "wx")
BLOCKS = (32, 64, 96, 128, 192, 256, 384, 512)  # candidate block widths (output columns)
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # row counts calibrated; m between two uses the larger's kernel
SAMPLE_BYTES = 16 << 20  # weights timed per shape: well past L2, so blocks come from memory as in a step
PLAN_VERSION = 1


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
        """One line per shape: its kernel at each calibrated row count."""
        return [f"{n_in}x{n_out}: " + " ".join(f"{rows}:{kernel}" for rows, kernel in entries)
                for (n_in, n_out), entries in self.table.items()]


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
    table = {}
    for shape, matrices in samples.items():
        kernels = candidates(shape[1], blocks)
        entries = []
        for m in rows:
            x = rng.standard_normal((m, shape[0])).astype(np.float32)
            entries.append((m, _fastest(kernels, x, matrices, repeats)))
        table[shape] = tuple(entries)
    return MatmulPlan(table)


def _fastest(kernels: list[Kernel], x: np.ndarray, matrices: list[np.ndarray], repeats: int) -> Kernel:
    best = {kernel: np.inf for kernel in kernels}
    alive = list(kernels)
    for _ in range(repeats):
        for kernel in alive:
            start = time.perf_counter()
            for w in matrices:
                product(x, w, kernel)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
        alive = sorted(alive, key=best.get)[:max(2, len(alive) // 2)]
    return min(kernels, key=best.get)


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


def cache_dir() -> Path:
    """Where measured plans are kept: $PAGEVIS_CACHE_DIR, else $XDG_CACHE_HOME/pagevis, else ~/.cache/pagevis."""
    if os.environ.get("PAGEVIS_CACHE_DIR"):
        return Path(os.environ["PAGEVIS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagevis"


def fingerprint() -> str:
    """What a measured plan depends on: the CPU, NumPy and its BLAS, and the BLAS thread count."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"v{PLAN_VERSION} | {cpu} x{os.cpu_count()} | numpy {np.__version__} | {blas_description()}"


def plan_for(matrices: Iterable[np.ndarray], path: Path | None = None) -> MatmulPlan:
    """The plan for these weights on this machine: read from the cache file when it holds every shape
    for this fingerprint, else measured (about a second or two) and written back. An unreadable or
    unwritable cache only costs the measurement."""
    matrices = list(matrices)
    path = path or cache_dir() / "matmul-plans.json"
    key = fingerprint()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    known = stored.get(key, {}) if isinstance(stored, dict) else {}
    shapes = {w.shape for w in matrices}
    try:
        plan = MatmulPlan.from_json(known)
        if shapes <= set(plan.table):
            return MatmulPlan({shape: plan.table[shape] for shape in shapes})
    except (ValueError, TypeError, AttributeError):
        known = {}
    plan = calibrate(sample_matrices(matrices))
    try:
        merged = {**known, **plan.to_json()}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({**(stored if isinstance(stored, dict) else {}), key: merged}, indent=1))
        temporary.replace(path)
    except OSError:
        pass
    return plan

"""The scoring loops of the policies that score every resident token at every eviction, one numba call per layer.

Each policy's NumPy definition stays in its own file (`score`, `head_scores`: what the records show and what AdaKV
reads); these kernels compute the same sums in float64 for its per-step choice, where ~20 NumPy calls a layer (a
gather, a cast, a mean, a product per KV head, masks, sorts) cost more than the arithmetic. Dot products may be summed
in any order (fastmath reassoc: vectorised), so a score differs from NumPy's by float64 rounding only (BLAS sums in
its own order too); the tests compare every choice with the policies' brute-force references
(tests/test_engine_policies.py, tests/test_compression.py, tests/test_policy_kernels.py).

Compiled once and kept in numba's on-disk cache (cache=True), as the attention and weight kernels are.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_FLAGS = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}, "error_model": "numpy",
          "boundscheck": False}


@njit(**_FLAGS)
def keydiff_choice(unit, positions, window):  # pragma: no cover (numba)
    """KeyDiff's victim among the resident slots (positions >= 0) outside the `window` newest: per KV head the anchor
    is the mean of every resident unit key, a token's score minus the mean over KV heads of its key's cosine to the
    anchor; the lowest score goes, ties to the oldest position. unit (n_slots, n_kv, d) float32. Returns
    (flat slot, score), or (-1, inf) when every resident token is protected."""
    n_slots, n_kv, d = unit.shape
    count = 0
    for s in range(n_slots):
        if positions[s] >= 0:
            count += 1
    rows = np.empty(count, np.int64)
    i = 0
    for s in range(n_slots):
        if positions[s] >= 0:
            rows[i] = s
            i += 1
    if count <= window:
        return -1, np.inf
    cutoff = np.iinfo(np.int64).max  # positions at or after it are the window's
    if window > 0:
        cutoff = np.sort(positions[rows])[count - window]
    total = np.zeros(count)
    anchor = np.empty(d)
    for h in range(n_kv):
        anchor[:] = 0.0
        for r in rows:
            for j in range(d):
                anchor[j] += unit[r, h, j]
        square = 0.0
        for j in range(d):
            anchor[j] /= count
            square += anchor[j] * anchor[j]
        norm = math.sqrt(square)
        if not norm > 0:
            norm = 1.0
        for i in range(count):
            r = rows[i]
            dot = 0.0
            for j in range(d):
                dot += unit[r, h, j] * anchor[j]
            total[i] += -dot / norm
    victim, best, oldest = -1, np.inf, np.iinfo(np.int64).max
    for i in range(count):
        r = rows[i]
        if positions[r] >= cutoff:
            continue
        score = total[i] / n_kv
        if score < best or (score == best and positions[r] < oldest):
            victim, best, oldest = r, score, positions[r]
    return victim, best


@njit(**_FLAGS)
def most_similar(unit, survivors, victim):  # pragma: no cover (numba)
    """The survivor (flat slot where `survivors` is True) whose unit keys are most like the victim's: the largest sum
    over KV heads of the cosines (the first such slot on a tie), or -1 if none survives."""
    n_slots, n_kv, d = unit.shape
    target, best = -1, -np.inf
    for s in range(n_slots):
        if not survivors[s]:
            continue
        dot = 0.0
        for h in range(n_kv):
            for j in range(d):
                dot += np.float64(unit[s, h, j]) * np.float64(unit[victim, h, j])
        if target < 0 or dot > best:
            target, best = s, dot
    return target

"""Positions written compactly as runs ("0–3, 17, 40–43"): the page grid's tooltips, the block table and the
narration all name a page's positions this way."""

from __future__ import annotations

import numpy as np


def runs(positions) -> list[tuple[int, int]]:
    """Sorted positions as (first, last) runs of consecutive ones."""
    values = np.unique(np.asarray(positions, dtype=np.int64))
    if not values.size:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [values.size - 1]])
    return [(int(values[a]), int(values[b])) for a, b in zip(starts, ends)]


def run_list(positions, max_runs: int = 4) -> str:
    """A page's positions as they are, compactly: "0–3, 17, 40–43" (and "+N more runs" past max_runs):
    token-level policies scatter a page's tokens, and a min–max span would claim positions it lacks."""
    found = runs(positions)
    if not found:
        return "—"
    text = ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in found[:max_runs])
    return text + (f", +{len(found) - max_runs} more runs" if len(found) > max_runs else "")


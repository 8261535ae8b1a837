"""Per-step data of a session or a trace as columns: NumPy arrays by name, or a pandas DataFrame when pandas is
installed. One row per step; the columns are the step record's own numbers (pagevis.engine.step_record), the
oracle's when it ran, and the negative log-likelihoods of a teacher-forced session."""

from __future__ import annotations

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import EventArray

ORACLE = ("kl", "top1_agree", "lost_attention")


def columns(records, nll: list[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The records as columns (each a NumPy array, one value per step). nll: per step, the negative
    log-likelihoods of the text's tokens it predicted (a teacher-forced session): their sum and count."""
    out: dict[str, list] = {name: [] for name in (
        "step", "kind", "n_tokens", "first_position", "last_position", "next_token", "next_text",
        "resident_tokens", "pages_used", "evictions", "evictions_total", "seconds")}
    oracle = bool(records) and records[0].oracle is not None
    for name in ORACLE if oracle else ():
        out[name] = []
    for record in records:
        out["step"].append(record.step)
        out["kind"].append(record.kind)
        out["n_tokens"].append(len(record.token_ids))
        out["first_position"].append(record.positions[0] if record.positions else -1)
        out["last_position"].append(record.positions[-1] if record.positions else -1)
        out["next_token"].append(record.next_token)
        out["next_text"].append(record.next_text)
        out["resident_tokens"].append(record.resident_tokens)
        out["pages_used"].append(record.pages_used)
        out["evictions"].append(_evictions(record))
        out["evictions_total"].append(record.evictions_total)
        out["seconds"].append(record.timings.get("total", np.nan))
        for name in ORACLE if oracle else ():
            out[name].append(getattr(record.oracle, name))
    arrays = {name: np.asarray(values, dtype=object if name in ("kind", "next_text") else None)
              for name, values in out.items()}
    if nll is not None:
        arrays["scored"] = np.array([len(x) for x in nll], dtype=np.int64)
        arrays["nll_sum"] = np.array([float(np.sum(x)) for x in nll], dtype=np.float64)
    return arrays


def _evictions(record) -> int:
    """Tokens evicted this step, all layers."""
    events = record.events
    if isinstance(events, EventArray):
        return len(events.of_kind(EventKind.EVICT))
    return sum(1 for e in events if e.kind is EventKind.EVICT)


def frame(arrays: dict[str, np.ndarray]):
    """A pandas DataFrame of the columns when pandas is installed, else the dict of arrays itself."""
    try:
        import pandas
    except ImportError:
        return arrays
    return pandas.DataFrame(arrays)

"""The GUI's model: every StepRecord of one session (live or replayed) and what views derive from them.

Qt-free. The worker thread never touches a Timeline; records reach it through `extend()` on the UI thread.
Derived series grow incrementally so that a redraw costs the same at step 10 and at step 10 000.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..decoding import SessionConfig, StepRecord
from ..engine import EventKind


class Eviction(NamedTuple):
    step: int
    layer: int
    page: int
    slot: int
    position: int
    token: str
    reason: str
    score: float


@dataclass(frozen=True)
class SessionInfo:
    """What a view needs to know about the session besides its records."""

    model_label: str
    prompt: str
    prompt_ids: tuple[int, ...]
    config: SessionConfig
    n_layers: int
    n_heads: int
    cache_bytes: int = 0
    n_kv_heads: int = 0  # 0: unknown (a trace without it); query head h reads KV head h // (n_heads // n_kv_heads)


class Timeline:
    def __init__(self, info: SessionInfo, token_text: Callable[[int], str]):
        self.info = info
        self._token_text = token_text
        self._texts: dict[int, str] = {}
        self.records: list[StepRecord] = []
        self.token_ids: list[int] = []  # token id at each position that has entered the cache
        self.evictions: list[Eviction] = []
        self._eviction_steps: list[int] = []
        self._eviction_columns = (np.zeros((3, 0)), 0)  # (step, layer, position) × evictions, and how many
        self.written_upto: list[int] = []  # per record: number of positions written so far
        self._series: dict[str, list[float]] = {name: [] for name in SERIES}
        self._evicted_per_layer: list[np.ndarray] = []
        self._attention: dict[tuple[int, int | None], _AttentionBuffer] = {}

    # --- growth ----------------------------------------------------------------------------------
    def extend(self, records: list[StepRecord]) -> None:
        for record in records:
            self._append(record)

    def _append(self, record: StepRecord) -> None:
        for token, position in zip(record.token_ids, record.positions):
            if position >= len(self.token_ids):
                self.token_ids.extend([-1] * (position + 1 - len(self.token_ids)))
            self.token_ids[position] = token
        self.written_upto.append(len(self.token_ids))
        per_layer = np.zeros(self.info.n_layers, dtype=np.int32)
        for event in record.events:
            if event.kind is EventKind.EVICT:
                per_layer[event.layer] += 1
                self.evictions.append(Eviction(
                    event.step if event.step >= 0 else record.step, event.layer, event.page, event.slot,
                    event.position, self.position_text(event.position), event.reason, float(event.score)))
                self._eviction_steps.append(record.step)
        self._evicted_per_layer.append(per_layer)
        s = self._series
        total = record.timings.get("total", float("nan"))
        s["resident_tokens"].append(record.resident_tokens)
        s["pages_used"].append(record.pages_used)
        s["tokens"].append(len(record.token_ids))
        s["latency_ms"].append(total * 1e3)
        s["tokens_per_s"].append(len(record.token_ids) / total if total > 0 else float("nan"))
        oracle = record.oracle
        s["kl"].append(oracle.kl if oracle else float("nan"))
        s["top1_agree"].append(float(oracle.top1_agree) if oracle else float("nan"))
        s["lost_attention"].append(oracle.lost_attention if oracle else float("nan"))
        self.records.append(record)

    # --- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id) if token_id >= 0 else ""
        return text

    def position_text(self, position: int) -> str:
        if 0 <= position < len(self.token_ids):
            return self.token_text(self.token_ids[position])
        return ""

    def n_positions(self, index: int) -> int:
        """Positions written up to and including record `index`."""
        return self.written_upto[index] if self.records else 0

    def evictions_until(self, index: int) -> int:
        """How many evictions (all layers) happened in records 0..index."""
        return bisect.bisect_right(self._eviction_steps, self.records[index].step) if self.records else 0

    def eviction_columns(self) -> np.ndarray:
        """(3, evictions) float64: the step, layer and position of every eviction so far, in order."""
        columns, count = self._eviction_columns
        if count != len(self.evictions):
            new = np.array([(e.step, e.layer, e.position) for e in self.evictions[count:]], dtype=np.float64)
            columns = np.concatenate([columns, new.reshape(-1, 3).T], axis=1)
            self._eviction_columns = (columns, len(self.evictions))
        return columns

    def series(self, name: str, upto: int | None = None) -> np.ndarray:
        values = self._series[name] if upto is None else self._series[name][: upto + 1]
        return np.asarray(values, dtype=np.float64)

    def evictions_per_step(self, layer: int | None = None) -> np.ndarray:
        if not self._evicted_per_layer:
            return np.zeros(0)
        counts = self._eviction_counts()
        return counts.sum(axis=1) if layer is None else counts[:, layer]

    def _eviction_counts(self) -> np.ndarray:
        """(records, layers) evictions, stacked once per new record rather than on every call."""
        cached = getattr(self, "_counts", None)
        if cached is None or len(cached) != len(self._evicted_per_layer):
            cached = self._counts = np.stack(self._evicted_per_layer)
        return cached

    def tokens_per_second(self, index: int, window: int = 16) -> float:
        """Decode speed over the last `window` decode steps up to `index` (forward + sampling time)."""
        times = [r.timings.get("total", 0.0) for r in self.records[max(0, index + 1 - window): index + 1]
                 if r.kind == "decode"]
        return len(times) / sum(times) if times and sum(times) > 0 else float("nan")

    def attention(self, layer: int, head: int | None, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps, positions) attention of the step's last query for records 0..index, and a bool
        matrix of the same shape that is True where the position had been evicted by then."""
        key = (layer, head)
        buffer = self._attention.get(key)
        if buffer is None:
            buffer = self._attention[key] = _AttentionBuffer()
        buffer.fill(self, layer, head, index + 1)
        n = self.n_positions(index)
        return buffer.weights[: index + 1, :n], buffer.evicted[: index + 1, :n]


def _trace_kv_heads(trace) -> int:
    """KV heads of the traced model when the trace says (a synthetic spec does), else 0 (unknown)."""
    spec = getattr(trace, "model_spec", None)
    return spec.n_kv_heads if spec is not None and spec.kind == "synthetic" else 0


def timeline_from_trace(trace) -> Timeline:
    """The timeline a replay shows: a trace's records, with its own token texts."""
    texts = dict(trace.token_texts)
    first = trace.records[0] if trace.records else None
    n_layers = first.slot_maps.shape[0] if first is not None else 1
    n_heads = first.attention[0].shape[0] if first is not None and first.attention else 1
    info = SessionInfo(f"{trace.model_label} (trace)", trace.prompt, tuple(trace.prompt_ids), trace.config,
                       n_layers, n_heads, 0, _trace_kv_heads(trace))
    timeline = Timeline(info, lambda token: texts.get(token, f"<{token}>"))
    timeline.extend(list(trace.records))
    return timeline


SERIES = ("tokens", "resident_tokens", "pages_used", "latency_ms", "tokens_per_s", "kl", "top1_agree", "lost_attention")


class _AttentionBuffer:
    """Rows of an attention heatmap, computed once per record and kept (grown by doubling)."""

    def __init__(self):
        self.rows = 0
        self.weights = np.zeros((0, 0), dtype=np.float32)
        self.evicted = np.zeros((0, 0), dtype=bool)

    def fill(self, timeline: Timeline, layer: int, head: int | None, rows: int) -> None:
        if rows <= self.rows:
            return
        width = timeline.written_upto[rows - 1]
        if rows > self.weights.shape[0] or width > self.weights.shape[1]:
            shape = (max(rows, 2 * self.weights.shape[0], 16), max(width, 2 * self.weights.shape[1], 16))
            for name, dtype in (("weights", np.float32), ("evicted", bool)):
                grown = np.zeros(shape, dtype=dtype)
                old = getattr(self, name)
                grown[: old.shape[0], : old.shape[1]] = old
                setattr(self, name, grown)
        cols = self.weights.shape[1]
        for row in range(self.rows, rows):
            record = timeline.records[row]
            if layer in record.attention_layers:  # a trace may hold attention for some layers only
                by_position = record.attention_over_positions(layer, cols)
                self.weights[row] = by_position.mean(axis=0) if head is None else by_position[head]
            written = timeline.written_upto[row]
            self.evicted[row, :written] = ~record.resident_mask(layer, written)
        self.rows = rows

"""StepRecord: the immutable snapshot of one decode (or prefill) step — everything a view, a trace or a
summary needs, so that they read it rather than the live engine.

Its fields are declared once, in the StepRecord class below, each with its row (record_fields.py says what a row
holds); the timeline's spill and the trace format derive their parts and arrays from them (TABLE)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagevis.engine.record_fields import RecordTable, row
from pagevis.kvcache import COUNT_NAMES, CacheEvent, EventKind


@dataclass(frozen=True)
class OracleStep:
    """The bounded cache against the full (never-evicting) cache on the same token stream."""

    kl: float  # KL(full || bounded) of the next-token distributions, nats
    top1_agree: bool  # do both caches put the same token first?
    logprob_bounded: float  # log-probability of the chosen token under the bounded cache
    logprob_full: float  # ... and under the full cache
    lost_attention: float  # share of the full model's attention on tokens the bounded cache evicted
    # per recorded layer (attention_layers), per query head: the share of the full cache's last-query
    # attention on the tokens the bounded cache evicted (for a per-head policy: the tokens that head's KV
    # head dropped); float32 values as tuples (records compare with ==); None when no layer is recorded
    lost_by_head: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True)
class TierStep:
    """What a step did with the disk tier or page selection, per layer.

    counts:       (n_layers, 5) int64, columns COUNT_NAMES: pages read from RAM, pages read from disk
                  (faults), pages that left RAM, bytes read from and written to the disk tier
    page_maps:    (len(attention_layers), n_page_ids, page_size) int32, for the recorded layers only (it
                  grows with the disk tier): token position per slot of every page id (with a disk tier,
                  page id = disk frame), -1 empty: what `attention` columns index
    block_frames: per layer, the RAM frame of each block-table page (-1: on disk only)
    recall:       (n_layers,) float32, share of the full cache's attention (the oracle's) on the tokens
                  this step read; None without the oracle
    """

    counts: np.ndarray
    page_maps: np.ndarray
    block_frames: Sequence[tuple[int, ...]]
    recall: np.ndarray | None = None

    def count(self, name: str) -> np.ndarray:
        return self.counts[:, COUNT_NAMES.index(name)]

    def hit_rate(self) -> float:
        """Pages read from RAM over all pages read, all layers (NaN if nothing was read)."""
        hits, faults = self.count("hits").sum(), self.count("faults").sum()
        return float(hits / (hits + faults)) if hits + faults else float("nan")


MAX_TOKEN_ID = 2**31 - 1  # the largest token id a record (and a trace) may hold

# The step record, declared once: StepRecord's fields in order, each with its row (record_fields.row: what it holds,
# how it is stored, its range), from which the spill's parts (viewmodel/spill.py) and a trace's arrays and their
# read-time ranges (trace/schema.py, trace/file.py) are derived (TABLE, below).
# Adding a field: one annotated line in StepRecord. A "scalar" or "grid" (record_fields.py) needs nothing else: the
# session sets it, the spill and the trace carry it; give it `since` = the trace format version after the current
# one and a default (what older traces read back), and `bounds` for its range in a trace. A "custom" field also
# needs its codec in the spill and in trace/file.py (tests/test_record_fields.py checks every custom field has one).
@dataclass(frozen=True)
class StepRecord:
    """One step of a session: the immutable snapshot every view, trace and summary reads. Per-layer state has a
    leading layer axis over every layer; attention only for `attention_layers`."""

    step: int = field(metadata=row("0.. counts the session's records", "scalar", "<i8", bounds=(0, "T-1")))
    kind: str = field(metadata=row('"prefill" (a chunk of prompt tokens) or "decode" (one token)'))
    token_ids: tuple[int, ...] = field(metadata=row("the tokens that entered the cache in this step",
                                                    bounds=(0, MAX_TOKEN_ID)))
    positions: tuple[int, ...] = field(metadata=row("their positions", bounds=(0, "N-1")))
    next_token: int = field(metadata=row(
        "the token sampled from this step's logits (-1 for a prefill chunk that is not the prompt's last)",
        "scalar", "<i8", bounds=(-1, MAX_TOKEN_ID)))
    next_text: str = field(metadata=row("next_token's text (empty for -1)"))
    slot_maps: np.ndarray = field(metadata=row(
        "(n_layers, max_pages, page_size) int32, token position per physical slot, -1 empty", "grid", "<i4",
        delta=True, bounds=(-1, "N-1")))
    protected: np.ndarray = field(metadata=row(
        "(n_layers, max_pages, page_size) bool, slots the policy will not evict (e.g. sinks)", "grid", "|b1",
        delta=True))
    scores: np.ndarray = field(metadata=row(
        "(n_layers, max_pages, page_size) float32, the policy's keep-score per slot (NaN empty)", "grid", "<f4",
        delta=True))
    block_tables: Sequence[tuple[int, ...]] = field(metadata=row(
        "per layer, the page ids in logical order (RAM frames without a disk tier): a TablesAt view of the "
        "session's TableLog, or tuples", bounds=(-1, "B-1")))
    events: Sequence[CacheEvent] = field(metadata=row(
        "the step's cache events: an EventArray (compact rows) from a session, or a tuple"))
    attention_layers: tuple[int, ...] = field(metadata=row(
        "the layers whose attention is recorded (the session's record_layers)"))
    attention: tuple[np.ndarray, ...] = field(metadata=row(
        "per recorded layer, (n_heads, page ids * page_size) float16: the step's last query's weights over flat "
        "slots (page * page_size + slot); exactly 0 on empty slots, evicted tokens and tokens not read"))
    timings: dict[str, float] = field(default_factory=dict, metadata=row(
        "seconds: forward, sample, oracle, record, total"))
    resident_tokens: int = field(default=0, metadata=row("tokens in layer 0's cache", "scalar", "<i8",
                                                         bounds=(0, "C")))
    pages_used: int = field(default=0, metadata=row("pages in layer 0's block table", "scalar", "<i8",
                                                    bounds=(0, "B")))
    evictions_total: int = field(default=0, metadata=row("evictions over all layers since the session began",
                                                         "scalar", "<i8", bounds=(0, 2**62)))
    oracle: OracleStep | None = field(default=None, metadata=row(
        "the bounded cache against the full cache (with the oracle)"))
    tiers: TierStep | None = field(default=None, metadata=row(
        "with a disk tier or a page selection: the per-page state and what moved (slot_maps, protected and scores "
        "then describe the RAM frames)"))
    full_precision: np.ndarray | None = field(default=None, metadata=row(
        "with int4 / int2 storage, (n_layers, max_pages, page_size) bool: the RAM slots whose tokens are still in "
        "float32 (KIVI's residual window); None for other storage", "grid", "|b1", optional=True, delta=True,
        since=4))
    capacities: np.ndarray | None = field(default=None, metadata=row(
        "(n_layers,) int32, the tokens each layer may hold under the sequence's policy (less than the pool under "
        "pyramidkv or duo); None in traces before version 5", "layers", "<i4", optional=True, since=5,
        bounds=(0, "C")))

    def page_map(self, layer: int) -> np.ndarray:
        """(page ids, page_size) token position per slot of every page: what attention columns index.
        With a disk tier and a layer whose attention is not recorded, only its RAM frames are known."""
        if self.tiers is None or layer not in self.attention_layers:
            return self.slot_maps[layer]
        return self.tiers.page_maps[self.attention_layers.index(layer)]

    @property
    def evictions(self) -> tuple[CacheEvent, ...]:
        return tuple(e for e in self.events if e.kind is EventKind.EVICT)

    def attention_over_positions(self, layer: int, n_positions: int) -> np.ndarray:
        """(n_heads, n_positions) float32 attention of this step's last query by token position."""
        weights = self.attention[self.attention_layers.index(layer)]
        slots = self.page_map(layer).ravel()
        resident = slots >= 0
        out = np.zeros((weights.shape[0], n_positions), dtype=np.float32)
        keep = resident & (slots < n_positions)
        out[:, slots[keep]] = weights[:, keep]
        return out

    def resident_mask(self, layer: int, n_positions: int) -> np.ndarray:
        """(n_positions,) bool: which token positions are in the cache of `layer` after this step."""
        slots = self.page_map(layer).ravel()
        mask = np.zeros(n_positions, dtype=bool)
        mask[slots[(slots >= 0) & (slots < n_positions)]] = True
        return mask


# The `events` field's columns (kvcache/event_array.py; a trace's event_<column> arrays) and the range each keeps in a
# trace, checked when it is read (trace/schema.py check_values), bounds as FIELDS writes them. kind, policy and
# reason index the trace header's own tables and are checked against them there. Before trace version 3 an
# event's layer and page are never -1 (sequence events came with version 3).
MAX_SEQUENCE_ID = 2**31 - 1
EVENT_BOUNDS = {"step": (-1, "T-1"), "layer": (-1, "L-1"), "page": (-1, "B-1"), "slot": (-1, "S-1"),
                "position": (-1, "N-1"), "frame": (-1, "P-1"), "seq": (0, MAX_SEQUENCE_ID)}
# An event's `detail`, by its kind (kvcache/events.py): (low, high, what it holds); None: any value (a prefix hash).
# A kind not listed carries no detail: -1. KV is the trace's KV heads (its kv_layout; else its recorded query heads,
# else the most any model has). An index is bounded by what the trace has of it, so no view that loops over it or
# indexes with it (the narration's KV heads) runs past the trace's own size; a count no view iterates is bounded
# by its int32 range (a restarted session's prefix hit reuses tokens the trace never fed: not bounded by N).
DETAIL_BOUNDS: dict[str, tuple[int | str, int | str, str] | None] = {
    EventKind.EVICT.value: (-1, "N-1", "a merge's surviving position, else -1"),
    EventKind.SHARE.value: (1, MAX_SEQUENCE_ID, "the page's reference count"),
    EventKind.COPY_ON_WRITE.value: (0, "B-1", "the page copied from"),
    EventKind.FORK.value: (0, MAX_SEQUENCE_ID, "the parent sequence"),
    EventKind.PREFIX_HIT.value: (0, MAX_SEQUENCE_ID, "the tokens reused"),
    EventKind.STORE.value: None,
    EventKind.UNCACHE.value: None,
    EventKind.MASK.value: (0, "KV-1", "the KV head that dropped the token"),
    EventKind.SLIDE.value: (0, "S", "the tokens the page held"),
    EventKind.RECONSTRUCT.value: (0, MAX_SEQUENCE_ID, "the tokens the reconstruction pass fed"),
}
NO_DETAIL = (-1, -1, "none: this kind carries no detail")

TABLE = RecordTable(StepRecord)
FIELDS = TABLE.fields

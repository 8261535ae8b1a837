"""StepRecord: the immutable snapshot of one decode (or prefill) step — everything a view, a trace or a
summary needs, so nothing downstream ever reads the live engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

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


@dataclass(frozen=True)
class StepRecord:
    """One step of a session.

    step 0.. counts records; kind is "prefill" (a chunk of prompt tokens) or "decode" (one token).
    `token_ids`/`positions` are the tokens that entered the cache in this step; `next_token` is the
    token sampled from this step's logits (-1 for a prefill chunk that is not the prompt's last).

    Per-layer state is stored for every layer as arrays with a leading layer axis:
      slot_maps:   (n_layers, max_pages, page_size) int32, token position per physical slot, -1 empty
      protected:   (n_layers, max_pages, page_size) bool, slots the policy will not evict (e.g. sinks)
      scores:      (n_layers, max_pages, page_size) float32, the policy's keep-score per slot (NaN empty)
      block_tables: per layer, the page ids in logical order (RAM frames without a disk tier)
    Attention is stored for the layers in `attention_layers` only (the session's `record_layers`):
      attention[i]: (n_heads, page ids * page_size) float16, the step's last query's weights over
      flat slots (page * page_size + slot); exactly 0 on empty slots, evicted tokens and tokens not read.
    With a disk tier (or a page selection) `tiers` holds the per-page state and what moved; slot_maps,
    protected and scores then describe the RAM frames (what each frame holds).
    With int4 / int2 storage, full_precision: (n_layers, max_pages, page_size) bool, the RAM slots whose
    tokens are still in float32 (KIVI's residual window); None for other storage.
    """

    step: int
    kind: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    next_token: int
    next_text: str
    slot_maps: np.ndarray
    protected: np.ndarray
    scores: np.ndarray
    block_tables: Sequence[tuple[int, ...]]  # a TablesAt view of the session's TableLog, or tuples
    events: Sequence[CacheEvent]  # an EventArray (compact rows) from a session, or a tuple
    attention_layers: tuple[int, ...]
    attention: tuple[np.ndarray, ...]
    timings: dict[str, float] = field(default_factory=dict)  # seconds: forward, sample, oracle, total
    resident_tokens: int = 0  # in layer 0
    pages_used: int = 0  # in layer 0
    evictions_total: int = 0  # over all layers, since the session began
    oracle: OracleStep | None = None
    tiers: TierStep | None = None
    full_precision: np.ndarray | None = None

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

"""What `EngineState.snapshot()` and `Fleet.snapshot()` return (state.py): frozen dataclasses, read-only arrays
and tuples, safe to read on any thread while the state goes on changing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Counters:
    epoch: int
    batches: int  # distinct seqs applied (all epochs)
    replayed_batches: int  # of which came from the replay endpoint
    duplicates: int  # batches seen again (replay overlapping the live stream)
    last_seq: int | None  # in this epoch
    first_seq: int | None  # first seq applied in this epoch
    last_ts: float | None
    events: Mapping[str, int]  # events (not blocks) by type
    blocks_stored: int
    blocks_removed: int
    reused_stores: int  # BlockStored of a block already resident
    unknown_removes: int  # BlockRemoved of a block not resident
    dropped_stores: int  # refused by max_blocks
    decode_errors: int
    decode_errors_by_reason: Mapping[str, int]
    last_decode_error: str
    unknown_event_types: Mapping[str, int]
    gaps: int  # places where seqs were missing
    gaps_unrecovered: int  # of which replay could not fill every missing seq
    missing_batches: int  # seqs never applied
    history_from_seq: int | None  # at the start of this epoch the replay buffer began here (None: no replay)
    history_batches: int  # batches the replay buffer gave at the start of this epoch
    history_missing: int | None  # seqs from before the buffer (0: the whole history was rebuilt; None: unknown)


@dataclass(frozen=True)
class BlockInfo:
    hash: Any
    parent: Any
    medium: str
    group: int | None
    token_ids: tuple[int, ...]
    block_size: int
    seq: int
    ts: float
    extras: Mapping[str, Any]


@dataclass(frozen=True)
class TierInfo:
    index: int
    medium: str
    group: int | None
    resident: int


@dataclass(frozen=True)
class BlockColumns:
    """One row per slot; read-only arrays and tuples."""

    resident: np.ndarray  # bool
    tier: np.ndarray  # int32 index into EngineSnapshot.tiers, -1 for a free row
    parent_row: np.ndarray  # int32
    block_size: np.ndarray  # int32
    seq: np.ndarray  # int64, the batch that stored the block
    ts: np.ndarray  # float64, that batch's engine timestamp
    hashes: tuple
    parents: tuple
    tokens: tuple  # bytes (uint32 little-endian) or None
    extras: tuple  # dict of the optional fields that were not None, or None

    def token_ids(self, row: int) -> np.ndarray:
        data = self.tokens[row]
        return np.frombuffer(data or b"", dtype="<u4")  # frombuffer over bytes is read-only


@dataclass(frozen=True)
class History:
    """The last `StateLimits.history` batches, oldest first (read-only arrays)."""

    ts: np.ndarray
    seq: np.ndarray
    stored: np.ndarray  # blocks stored by the batch
    removed: np.ndarray  # blocks removed (cleared ones included)
    resident: np.ndarray  # resident blocks after it, all media


@dataclass(frozen=True)
class RecentBlock:
    hash: Any
    medium: str
    group: int | None
    seq: int
    ts: float


@dataclass(frozen=True)
class HotPrefix:
    hash: Any
    medium: str
    group: int | None
    restores: int  # times stored again within hot_window_s of its removal
    last_ts: float
    last_gap_s: float  # time between the last removal and the store after it


@dataclass(frozen=True)
class EngineSnapshot:
    name: str
    counters: Counters
    resident: Mapping[str, int]  # by medium
    tiers: tuple[TierInfo, ...]
    history: History
    recent_stored: tuple[RecentBlock, ...]  # newest last
    recent_removed: tuple[RecentBlock, ...]
    lifetimes: np.ndarray  # seconds, most recent last
    lifetimes_total: int
    lifetimes_mean_s: float
    hot: tuple[HotPrefix, ...]  # most restores first
    blocks: BlockColumns | None


@dataclass(frozen=True)
class FleetSnapshot:
    engines: tuple[EngineSnapshot, ...]
    shared_blocks: int  # hashes resident on GPU in two or more engines

"""What one serving engine's prefix cache holds, rebuilt from its KV events; no sockets, no Qt.

API (every class here is plain Python; a GUI renders `snapshot()` results, which are immutable, on any thread)

`EngineState(name, limits=StateLimits(), shared=None)` — one engine endpoint (one data-parallel rank).
- `apply_batch(seq, batch, replayed=False)`   apply a `DecodedBatch` (see events.py) stored under `seq`.
- `start_epoch()`                             the engine restarted: drop every block, count a new epoch.
- `note_decode_error(reason, detail)`         a message that did not decode (counted, last one kept).
- `note_duplicate()`, `note_gap(missing, recovered)`, `note_history(from_seq, batches, missing_before)`,
  `skip_seq(seq)`                             what the feed saw of the sequence numbers (feed.py).
- `block(hash, medium="GPU", group=None)`     a resident block as a `BlockInfo`, or None.
- `children(hash, medium="GPU", group=None)`  hashes of the resident blocks whose parent is `hash`.
- `roots(medium="GPU", group=None)`           resident blocks whose parent is None or not resident.
- `resident_by_medium()`                      {medium: resident block count}.
- `snapshot(blocks=True)`                     an `EngineSnapshot` (frozen; arrays read-only).
`Fleet()` — several engines: `add(name)` → EngineState, `engines`, `shared_gpu_blocks()` (hashes resident on GPU
in two or more engines, kept incrementally), `snapshot(blocks=True)` → `FleetSnapshot`.

What a block is: the key is (medium, group_idx, hash) — the same hash may be resident on GPU and CPU at once
(vLLM's offloading), and in several KV cache groups (hybrid models). A medium of None is "GPU" (vLLM's own
block pool always says "GPU"; SGLang says "GPU", "CPU_PINNED", "DISK", "EXTERNAL"). A BlockStored for a block
already resident is a reuse report (vLLM 0.34 re-emits reused prefix blocks): it changes nothing but a counter;
a BlockRemoved of a block not resident is counted (`unknown_removes`: events missed before the attach, or a
gap). AllBlocksCleared clears every medium. Blocks of one BlockStored chain: each block's parent is the one
before it, the first one's is `parent_block_hash`.

Storage, and the memory bound: blocks live in slots (rows). Per slot: hash, parent hash and extras as object
references, token ids packed as one `bytes` of little-endian uint32 (4 bytes a token), and numeric columns in
`array.array` (tier, block size, seq, ts, parent slot, sibling links: 30 bytes). Children are a linked list per
parent hash (no set per block). Measured by `python -m pagevis.bench.attach`: see docs/attach.md (target
≤ 1 GB RSS at 1 M resident blocks of 16 tokens). Everything else is bounded by `StateLimits`: resident blocks
per engine (`max_blocks`; more stores are dropped and counted), the batch history ring, recent hashes,
lifetimes sample, hot table, removal memory.

The snapshots' classes are in fleet_snapshot.py. Snapshot rows are slots: `BlockColumns.resident` marks the rows that hold a block; rows keep their block while
it is resident, so a view can lay out incrementally. `parent_row` is the parent's row when the parent is
resident in the same tier, else -1. A hostile stream can make parent links cycle: walk them with a visited set.
"""

from __future__ import annotations

import operator
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from pagevis.attach.events import (
    STORED_EXTRAS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    pack_tokens,
)
from pagevis.attach.events import _ClearedArray, _RemovedArray, _StoredArray
from pagevis.attach.tiers import Tier
from pagevis.attach.fleet_snapshot import (
    BlockColumns,
    BlockInfo,
    Counters,
    EngineSnapshot,
    FleetSnapshot,
    History,
    HotPrefix,
    RecentBlock,
    TierInfo,
)

GPU = "GPU"
MAX_TIERS = 64  # distinct (medium, group) pairs per engine; more are refused as decode errors
MAX_ERROR_NAMES = 32
_STORED = (BlockStored, _StoredArray)
_REMOVED = (BlockRemoved, _RemovedArray)
_CLEARED = (AllBlocksCleared, _ClearedArray)
_FREE = 0xFFFF
_extras_of = operator.attrgetter(*STORED_EXTRAS)
_NO_EXTRAS = (None,) * len(STORED_EXTRAS)


@dataclass(frozen=True)
class StateLimits:
    max_blocks: int = 4_000_000  # resident blocks per engine, all media
    history: int = 8192  # batches in the store/remove ring
    recent: int = 256  # recently stored / removed blocks kept
    lifetimes: int = 4096  # most recent block lifetimes kept
    hot_window_s: float = 10.0  # a block stored again within this long after its removal is "hot"
    hot_capacity: int = 1024  # hot blocks tracked (least recently hot dropped)
    removed_memory: int = 65_536  # removed hashes remembered per tier, to see them come back


def _frozen(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


class SharedIndex:
    """How many engines hold each hash on GPU; `shared` counts hashes held by two or more."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}
        self.shared = 0

    def add(self, block_hash: Any) -> None:
        count = self.counts.get(block_hash, 0) + 1
        self.counts[block_hash] = count
        if count == 2:
            self.shared += 1

    def discard(self, block_hash: Any) -> None:
        count = self.counts.get(block_hash, 0)
        if count <= 1:
            self.counts.pop(block_hash, None)
            return
        self.counts[block_hash] = count - 1
        if count == 2:
            self.shared -= 1


class _Ring:
    """Fixed-capacity columns of numbers; `ordered()` gives them oldest first."""

    def __init__(self, capacity: int, **dtypes: str):
        self.capacity, self.count = capacity, 0
        self.columns = {name: np.zeros(capacity, dtype) for name, dtype in dtypes.items()}

    def push(self, *values: float) -> None:
        at = self.count % self.capacity
        for column, value in zip(self.columns.values(), values):
            column[at] = value
        self.count += 1

    def ordered(self, name: str) -> np.ndarray:
        column = self.columns[name]
        if self.count <= self.capacity:
            return _frozen(column[:self.count].copy())
        at = self.count % self.capacity
        return _frozen(np.concatenate((column[at:], column[:at])))


class EngineState:
    """The resident blocks of one engine, rebuilt from its events (see the module docstring)."""

    def __init__(self, name: str, limits: StateLimits | None = None, shared: SharedIndex | None = None):
        self.name = name
        self.limits = limits or StateLimits()
        self._shared = shared
        self._epoch = 0
        self._counts: dict[str, int] = dict.fromkeys(
            ("batches", "replayed_batches", "duplicates", "blocks_stored", "blocks_removed", "reused_stores",
             "unknown_removes", "dropped_stores", "decode_errors", "gaps", "gaps_unrecovered", "missing_batches"), 0)
        self._events = dict.fromkeys(("BlockStored", "BlockRemoved", "AllBlocksCleared"), 0)
        self._errors: dict[str, int] = {}
        self._unknown_types: dict[str, int] = {}
        self._last_error = ""
        self._last_seq: int | None = None
        self._first_seq: int | None = None
        self._last_ts: float | None = None
        self._history_from: int | None = None
        self._history_batches = 0
        self._history_missing: int | None = None
        self._history = _Ring(self.limits.history, ts="f8", seq="i8", stored="i4", removed="i4", resident="i8")
        self._recent_stored: deque = deque(maxlen=self.limits.recent)
        self._recent_removed: deque = deque(maxlen=self.limits.recent)
        self._lifetimes: deque = deque(maxlen=self.limits.lifetimes)
        self._lifetimes_total = 0
        self._lifetime_sum = 0.0
        self._hot: OrderedDict[tuple, list] = OrderedDict()  # (medium, group, hash) -> [restores, last_ts, gap]
        self.block_size: int | None = None  # of the last BlockStored
        self.tokenless_blocks = 0  # stored without token ids (vLLM's offloading events before 0.20)
        self._clear_blocks()

    # --- applying ---------------------------------------------------------------------------------------------
    def apply_batch(self, seq: int, batch: DecodedBatch, replayed: bool = False) -> None:
        """Apply every event of `batch` (already validated by events.decode_payload) under sequence `seq`."""
        stored_before, removed_before = self._counts["blocks_stored"], self._counts["blocks_removed"]
        events = self._events
        for event in batch.events:
            kind = type(event)
            if kind in _STORED:
                events["BlockStored"] += 1
                self._apply_stored(event, seq, batch.ts)
            elif kind in _REMOVED:
                events["BlockRemoved"] += 1
                self._apply_removed(event, seq, batch.ts)
            elif kind in _CLEARED:
                events["AllBlocksCleared"] += 1
                self._counts["blocks_removed"] += self._resident
                self._clear_blocks()
        for name in batch.unknown:
            self.note_decode_error("unknown_event", f"event type {name!r}")
            self._count_name(self._unknown_types, name)
        self._counts["batches"] += 1
        self._counts["replayed_batches"] += replayed
        if self._first_seq is None:
            self._first_seq = seq
        self._last_seq, self._last_ts = seq, batch.ts
        self._history.push(batch.ts, seq, self._counts["blocks_stored"] - stored_before,
                           self._counts["blocks_removed"] - removed_before, self._resident)

    def start_epoch(self) -> None:
        """The engine restarted (its seq went back): forget its blocks; counters go on, `epoch` goes up."""
        self._clear_blocks()
        self._epoch += 1
        self._last_seq = self._first_seq = None
        self._history_from = self._history_missing = None
        self._history_batches = 0

    def note_decode_error(self, reason: str, detail: str = "") -> None:
        self._counts["decode_errors"] += 1
        self._count_name(self._errors, reason)
        self._last_error = f"{reason}: {detail}"[:300]

    def note_history(self, from_seq: int | None, batches: int, missing_before: int | None,
                     missing_inside: int = 0) -> None:
        """At the start of an epoch the replay buffer gave `batches` batches from `from_seq`; `missing_before` seqs
        came before it (None when nothing says), `missing_inside` were absent from it."""
        self._history_from, self._history_batches, self._history_missing = from_seq, batches, missing_before
        self._counts["missing_batches"] += missing_inside

    def skip_seq(self, seq: int) -> None:
        """A seq whose payload did not decode: spent (no gap, no replay), nothing applied."""
        if self._first_seq is None:
            self._first_seq = seq
        self._last_seq = seq

    def note_duplicate(self) -> None:
        self._counts["duplicates"] += 1

    def note_gap(self, missing: int, recovered: bool) -> None:
        """A gap in seqs; `missing` seqs of it were never applied (0 when replay filled it)."""
        self._counts["gaps"] += 1
        self._counts["gaps_unrecovered"] += not recovered
        self._counts["missing_batches"] += missing

    def _count_name(self, table: dict[str, int], name: str) -> None:
        if name in table or len(table) < MAX_ERROR_NAMES:
            table[name] = table.get(name, 0) + 1
        else:
            table["(other)"] = table.get("(other)", 0) + 1

    # --- blocks -----------------------------------------------------------------------------------------------
    def _clear_blocks(self) -> None:
        if self._shared is not None and getattr(self, "_tiers", None):
            for block_hash in set().union(*(tier.slot_of for tier in self._gpu_tiers)):
                self._shared.discard(block_hash)
        self._tiers: dict[tuple[str, int | None], Tier] = {}
        self._tier_list: list[Tier] = []
        self._gpu_tiers: list[Tier] = []
        self._resident = 0
        self._free: list[int] = []
        self._hash_of: list = []
        self._parent_of: list = []
        self._tokens_of: list = []
        self._extra_of: list = []
        self._tier_of = array("H")
        self._size_of = array("I")
        self._seq_of = array("q")
        self._ts_of = array("d")
        self._parent_slot = array("i")
        self._next = array("i")
        self._prev = array("i")

    def _tier(self, medium: str | None, group: int | None) -> Tier | None:
        key = (medium or GPU, group)
        tier = self._tiers.get(key)
        if tier is None:
            if len(self._tier_list) >= MAX_TIERS:
                self.note_decode_error("too_many_tiers", f"more than {MAX_TIERS} (medium, group) pairs")
                return None
            tier = self._tiers[key] = Tier(len(self._tier_list), key[0], group)
            self._tier_list.append(tier)
            if tier.medium == GPU:
                self._gpu_tiers.append(tier)
        return tier

    def _on_other_gpu_tier(self, block_hash: Any, tier: Tier) -> bool:
        return any(block_hash in other.slot_of for other in self._gpu_tiers if other is not tier)

    def _apply_stored(self, event: Any, seq: int, ts: float) -> None:
        tier = self._tier(event.medium, event.group_idx)
        if tier is None:
            return
        size = event.block_size
        width = 4 * size
        packed = pack_tokens(event.token_ids)
        self.block_size = size
        if not packed:
            self.tokenless_blocks += len(event.block_hashes)
        values = _extras_of(event)
        common = {} if values == _NO_EXTRAS else {k: v for k, v in zip(STORED_EXTRAS, values) if v is not None}
        extra_keys, lookahead = event.extra_keys, event.lookahead_token_ids
        parent = event.parent_block_hash
        slot_of, removed_at = tier.slot_of, tier.removed_at
        limit = self.limits.max_blocks
        shared = self._shared if tier.medium == GPU else None
        stored = 0
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in slot_of:
                self._counts["reused_stores"] += 1
                parent = block_hash
                continue
            if self._resident >= limit:
                self._counts["dropped_stores"] += 1
                parent = block_hash
                continue
            extra: dict | None = common or None
            if extra_keys is not None or lookahead is not None:
                extra = dict(common)
                if extra_keys is not None and extra_keys[i] is not None:
                    extra["extra_keys"] = extra_keys[i]
                if lookahead is not None:
                    extra["lookahead_token_ids"] = lookahead[i]
            slot = self._new_slot(tier.index, size, seq, ts)
            self._hash_of[slot] = block_hash
            self._parent_of[slot] = parent
            self._tokens_of[slot] = packed[i * width:(i + 1) * width]
            self._extra_of[slot] = extra
            self._link(tier, slot, block_hash, parent)
            slot_of[block_hash] = slot
            self._resident += 1
            stored += 1
            removed = removed_at.pop(block_hash, None)
            if tier.children is not None:
                tier.children.add((parent, self._tokens_of[slot]), slot)
            if removed is not None:
                tier.forget_removed(block_hash, removed)
                if ts - removed[0] <= self.limits.hot_window_s:
                    self._mark_hot(tier, block_hash, ts, ts - removed[0])
            if shared is not None and not (len(self._gpu_tiers) > 1 and self._on_other_gpu_tier(block_hash, tier)):
                shared.add(block_hash)
            parent = block_hash
        self._counts["blocks_stored"] += stored
        recent = self._recent_stored
        for block_hash in event.block_hashes[-self.limits.recent:]:
            recent.append((block_hash, tier.medium, tier.group, seq, ts))

    def _new_slot(self, tier: int, size: int, seq: int, ts: float) -> int:
        if self._free:
            slot = self._free.pop()
            self._tier_of[slot], self._size_of[slot], self._seq_of[slot], self._ts_of[slot] = tier, size, seq, ts
            return slot
        slot = len(self._hash_of)
        for column in (self._hash_of, self._parent_of, self._tokens_of, self._extra_of):
            column.append(None)
        self._tier_of.append(tier)
        self._size_of.append(size)
        self._seq_of.append(seq)
        self._ts_of.append(ts)
        self._parent_slot.append(-1)
        self._next.append(-1)
        self._prev.append(-1)
        return slot

    def _link(self, tier: Tier, slot: int, block_hash: Any, parent: Any) -> None:
        """Put `slot` first among its parent's children; adopt its own children (stored before it came back)."""
        heads, nxt, prev, parent_slot = tier.heads, self._next, self._prev, self._parent_slot
        head = heads.get(parent, -1)
        nxt[slot], prev[slot] = head, -1
        if head >= 0:
            prev[head] = slot
        heads[parent] = slot
        parent_slot[slot] = tier.slot_of.get(parent, -1) if parent != block_hash else -1
        child = heads.get(block_hash, -1)
        while child >= 0:
            if child != slot:
                parent_slot[child] = slot
            child = nxt[child]

    def _apply_removed(self, event: Any, seq: int, ts: float) -> None:
        tier = self._tier(event.medium, event.group_idx)
        if tier is None:
            return
        slot_of, removed_at = tier.slot_of, tier.removed_at
        memory = self.limits.removed_memory
        shared = self._shared if tier.medium == GPU else None
        removed = 0
        for block_hash in event.block_hashes:
            slot = slot_of.pop(block_hash, None)
            if slot is None:
                self._counts["unknown_removes"] += 1
                continue
            self._unlink(tier, slot, block_hash)
            lifetime = ts - self._ts_of[slot]
            record = (ts, self._parent_of[slot], self._tokens_of[slot], self._ts_of[slot], self._extra_of[slot])
            if tier.children is not None:
                tier.children.discard((record[1], record[2]), slot)
            self._lifetimes.append(lifetime)
            self._lifetimes_total += 1
            self._lifetime_sum += lifetime
            self._hash_of[slot] = self._parent_of[slot] = self._tokens_of[slot] = self._extra_of[slot] = None
            self._tier_of[slot] = _FREE
            self._free.append(slot)
            self._resident -= 1
            removed += 1
            removed_at[block_hash] = record
            removed_at.move_to_end(block_hash)
            tier.remember_removed(block_hash, record)
            if len(removed_at) > memory:
                tier.forget_removed(*removed_at.popitem(last=False))
            if shared is not None and not (len(self._gpu_tiers) > 1 and self._on_other_gpu_tier(block_hash, tier)):
                shared.discard(block_hash)
        self._counts["blocks_removed"] += removed
        recent = self._recent_removed
        for block_hash in event.block_hashes[-self.limits.recent:]:
            recent.append((block_hash, tier.medium, tier.group, seq, ts))

    def _unlink(self, tier: Tier, slot: int, block_hash: Any) -> None:
        nxt, prev, parent_slot = self._next, self._prev, self._parent_slot
        before, after = prev[slot], nxt[slot]
        if before >= 0:
            nxt[before] = after
        else:
            parent = self._parent_of[slot]
            if after >= 0:
                tier.heads[parent] = after
            else:
                del tier.heads[parent]
        if after >= 0:
            prev[after] = before
        child = tier.heads.get(block_hash, -1)
        while child >= 0:
            parent_slot[child] = -1
            child = nxt[child]
        parent_slot[slot] = nxt[slot] = prev[slot] = -1

    def _mark_hot(self, tier: Tier, block_hash: Any, ts: float, gap: float) -> None:
        key = (tier.medium, tier.group, block_hash)
        entry = self._hot.pop(key, None) or [0, ts, gap]
        entry[0] += 1
        entry[1], entry[2] = ts, gap
        self._hot[key] = entry
        if len(self._hot) > self.limits.hot_capacity:
            self._hot.popitem(last=False)

    # --- queries ----------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    @property
    def resident_blocks(self) -> int:
        return self._resident

    def resident_by_medium(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tier in self._tier_list:
            counts[tier.medium] = counts.get(tier.medium, 0) + len(tier.slot_of)
        return counts

    def block(self, block_hash: Any, medium: str = GPU, group: int | None = None) -> BlockInfo | None:
        tier = self._tiers.get((medium, group))
        slot = tier.slot_of.get(block_hash) if tier else None
        if slot is None:
            return None
        tokens = tuple(np.frombuffer(self._tokens_of[slot], "<u4").tolist())
        return BlockInfo(block_hash, self._parent_of[slot], tier.medium, tier.group, tokens, self._size_of[slot],
                         self._seq_of[slot], self._ts_of[slot], MappingProxyType(dict(self._extra_of[slot] or {})))

    def children(self, block_hash: Any, medium: str = GPU, group: int | None = None) -> list:
        tier = self._tiers.get((medium, group))
        found, child = [], tier.heads.get(block_hash, -1) if tier else -1
        while child >= 0:
            found.append(self._hash_of[child])
            child = self._next[child]
        return found

    def roots(self, medium: str = GPU, group: int | None = None) -> list:
        tier = self._tiers.get((medium, group))
        if tier is None:
            return []
        return [h for h, slot in tier.slot_of.items() if self._parent_slot[slot] < 0]

    def counters(self) -> Counters:
        c = self._counts
        return Counters(
            epoch=self._epoch, batches=c["batches"], replayed_batches=c["replayed_batches"],
            duplicates=c["duplicates"], last_seq=self._last_seq, first_seq=self._first_seq, last_ts=self._last_ts,
            events=MappingProxyType(dict(self._events)), blocks_stored=c["blocks_stored"],
            blocks_removed=c["blocks_removed"], reused_stores=c["reused_stores"],
            unknown_removes=c["unknown_removes"], dropped_stores=c["dropped_stores"],
            decode_errors=c["decode_errors"], decode_errors_by_reason=MappingProxyType(dict(self._errors)),
            last_decode_error=self._last_error, unknown_event_types=MappingProxyType(dict(self._unknown_types)),
            gaps=c["gaps"], gaps_unrecovered=c["gaps_unrecovered"], missing_batches=c["missing_batches"],
            history_from_seq=self._history_from, history_batches=self._history_batches,
            history_missing=self._history_missing)

    def snapshot(self, blocks: bool = True) -> EngineSnapshot:
        """Everything a view draws, copied: safe to read on another thread while this state goes on."""
        tiers = tuple(TierInfo(t.index, t.medium, t.group, len(t.slot_of)) for t in self._tier_list)
        history = History(*(self._history.ordered(name) for name in ("ts", "seq", "stored", "removed", "resident")))
        hot = sorted(self._hot.items(), key=lambda item: (-item[1][0], -item[1][1]))
        lifetimes_total = self._lifetimes_total
        return EngineSnapshot(
            name=self.name, counters=self.counters(), resident=MappingProxyType(self.resident_by_medium()),
            tiers=tiers, history=history, recent_stored=tuple(RecentBlock(*r) for r in self._recent_stored),
            recent_removed=tuple(RecentBlock(*r) for r in self._recent_removed),
            lifetimes=_frozen(np.array(self._lifetimes, dtype=np.float64)),
            lifetimes_total=lifetimes_total,
            lifetimes_mean_s=self._lifetime_sum / lifetimes_total if lifetimes_total else 0.0,
            hot=tuple(HotPrefix(h, medium, group, n, last, gap) for (medium, group, h), (n, last, gap) in hot),
            blocks=self._block_columns() if blocks else None)

    def _block_columns(self) -> BlockColumns:
        tier = np.array(self._tier_of, dtype=np.int32)
        resident = tier != _FREE
        tier[~resident] = -1
        return BlockColumns(
            resident=_frozen(resident), tier=_frozen(tier),
            parent_row=_frozen(np.array(self._parent_slot, dtype=np.int32)),
            block_size=_frozen(np.array(self._size_of, dtype=np.int32)),
            seq=_frozen(np.array(self._seq_of, dtype=np.int64)), ts=_frozen(np.array(self._ts_of, dtype=np.float64)),
            hashes=tuple(self._hash_of), parents=tuple(self._parent_of), tokens=tuple(self._tokens_of),
            extras=tuple(self._extra_of))

    def attach_shared(self, shared: SharedIndex) -> None:
        """Count this engine's GPU blocks in `shared` from now on (and the ones it holds now)."""
        self._shared = shared
        seen: set = set()
        for tier in self._gpu_tiers:
            for block_hash in tier.slot_of:
                if block_hash not in seen:
                    seen.add(block_hash)
                    shared.add(block_hash)


@dataclass
class Fleet:
    """Several engines (endpoints, data-parallel ranks) and the GPU blocks they hold in common. Whoever changes
    an engine's state from another thread holds `lock`; `snapshot()` takes it too."""

    limits: StateLimits = field(default_factory=StateLimits)
    engines: list[EngineState] = field(default_factory=list)
    shared: SharedIndex = field(default_factory=SharedIndex)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def add(self, name: str) -> EngineState:
        with self.lock:
            engine = EngineState(name, self.limits)
            engine.attach_shared(self.shared)
            self.engines.append(engine)
            return engine

    def shared_gpu_blocks(self) -> int:
        return self.shared.shared

    def snapshot(self, blocks: bool = True) -> FleetSnapshot:
        with self.lock:
            return FleetSnapshot(tuple(engine.snapshot(blocks) for engine in self.engines), self.shared.shared)

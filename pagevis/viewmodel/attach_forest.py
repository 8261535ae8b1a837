"""From `pagevis attach` snapshots (pagevis/attach/state.py) to what the attach window draws, with no Qt (a test
checks): the prefix
forest's rows for the reusable forest view (views/prefix_forest.py), with its marks (newest stored, just removed,
hot, held by another engine), the overlap between engines, store / remove rates, the lifetime histogram, hot
prefix rows and the metrics series. Everything here reads immutable snapshots only; nothing here keeps state
that a snapshot does not hold, except the previous forest (to mark what changed since it).

"Since the last frame": the newest stored blocks are the ones stored by batches after the previous forest frame's
last seq (the last batch only, for a first frame); the just removed ones are those removed since then that the
previous frame held: they come back for one frame as ghost rows, where the previous frame had them (a ghost's
former children hang under it again for that frame).
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from pagevis.attach.state import GPU, EngineSnapshot, FleetSnapshot, History
from pagevis.viewmodel.forest_rows import HOT, NEWEST, REMOVED, SHARED, ColourClass, ForestRows

MEDIUM_COLORS = {"GPU": "#4fa3ff", "CPU": "#ffb020", "CPU_PINNED": "#ffb020", "STORAGE": "#3ddc84",
                 "DISK": "#3ddc84", "EXTERNAL": "#b48cf2"}
OTHER_COLORS = ("#e86fb0", "#9bd15a", "#29c7c7", "#c9a26b", "#8fa7ff", "#ff8f6b")
ORDER_SHIFT = 1 << 40  # sibling order: tier first, then the seq that stored the block
MAX_TEXT_TOKENS = 512  # tokens shown / detokenized in a hover text
MAX_OVERLAP_ENGINES = 16  # pairwise overlap for up to this many engines (held-elsewhere counts for any number)

Detokenizer = Callable[[Sequence[int]], str]


def medium_color(medium: str, index: int = 0) -> str:
    return MEDIUM_COLORS.get(medium.upper(), OTHER_COLORS[index % len(OTHER_COLORS)])


def format_hash(value: Any) -> str:
    """Ints as ints (what vLLM sends and --save-state writes), bytes as hex."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return str(value)


def short_hash(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return "#" + bytes(value)[:3].hex()
    if isinstance(value, int):
        return f"#{value % (1 << 24):06x}"
    return str(value)[:8]


def format_ts(ts: float) -> str:
    if not math.isfinite(ts) or not 0 <= ts < 1e11:
        return f"{ts:g}"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


CHUNK = 32_768  # items per C call while building big dicts and sets: between calls another thread may take the GIL


def _index(keys: Sequence, values: Sequence) -> dict:
    """dict(zip(keys, values)) in chunks: one C call over a million items would hold the GIL (and so the UI
    thread) for its whole duration, 100 ms and more on a loaded machine."""
    out: dict = {}
    for start in range(0, len(keys), CHUNK):
        out.update(zip(keys[start:start + CHUNK], values[start:start + CHUNK]))
    return out


def _pick(values: tuple, rows: np.ndarray) -> list:
    """values[r] for each r (C speed: a million in a few tens of ms; in chunks, as _index)."""
    out: list = []
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start:start + CHUNK].tolist()
        out.extend(operator.itemgetter(*chunk)(values) if len(chunk) > 1 else [values[chunk[0]]])
    return out


@dataclass(frozen=True)
class Ghost:
    tier: tuple  # (medium, group)
    hash: Any
    parent: Any
    block_size: int
    seq: int
    ts: float
    tokens: bytes | None
    removed_seq: int
    removed_ts: float


@dataclass(frozen=True)
class EngineForest:
    """The forest rows made from one engine's full snapshot, and what the next frame needs to mark changes."""

    rows: ForestRows
    engine: EngineSnapshot  # with blocks
    live: np.ndarray  # the snapshot row (slot) of each forest row that is a block
    index: dict  # (medium, group) -> {hash: snapshot row}
    inverse: np.ndarray  # snapshot row -> forest row (-1: free)
    ghosts: tuple[Ghost, ...]  # forest rows len(live) ... are these
    position: int | None = None  # the playback position the snapshot was taken at (None: live)

    @property
    def name(self) -> str:
        return self.engine.name

    def block_row(self, block_hash: Any, medium: str = GPU, group: int | None = None) -> int:
        slot = self.index.get((medium, group), {}).get(block_hash)
        return -1 if slot is None else int(self.inverse[slot])

    def tokens(self, row: int) -> np.ndarray:
        if row < len(self.live):
            blocks = self.engine.blocks
            assert blocks is not None  # live rows are rows of the snapshot's blocks
            return blocks.token_ids(int(self.live[row]))
        data = self.ghosts[row - len(self.live)].tokens
        return np.frombuffer(data or b"", dtype="<u4")


def gpu_hashes(engine: EngineSnapshot) -> set:
    cols = engine.blocks
    if cols is None:
        return set()
    gpu = [t.index for t in engine.tiers if t.medium == GPU]
    rows = np.flatnonzero(np.isin(cols.tier, gpu) & cols.resident)
    out: set = set()
    for start in range(0, len(rows), CHUNK):  # in chunks, as _index
        out.update(map(cols.hashes.__getitem__, rows[start:start + CHUNK].tolist()))
    return out


@dataclass(frozen=True)
class Overlap:
    """Blocks several engines hold on GPU (what a KV-aware router scores): per engine its GPU blocks and how many
    of them another engine holds too; pairwise counts for up to MAX_OVERLAP_ENGINES engines."""

    names: tuple[str, ...]
    gpu: tuple[int, ...]
    held_elsewhere: tuple[int, ...]
    pairwise: np.ndarray | None  # (engines, engines) int64, the diagonal = gpu
    shared_blocks: int  # hashes on GPU in two or more engines (the state's own count)


def overlap(fleet: FleetSnapshot) -> tuple[Overlap, list[set]]:
    """The overlap table, and each engine's GPU hashes (for the forest's SHARED marks)."""
    sets = [gpu_hashes(engine) for engine in fleet.engines]
    count: dict = {}
    if len(sets) > 1:
        for hashes in sets:
            for h in hashes:
                count[h] = count.get(h, 0) + 1
    held = tuple(sum(1 for h in s if count.get(h, 0) > 1) for s in sets) if len(sets) > 1 else (0,) * len(sets)
    pairwise = None
    if 1 < len(sets) <= MAX_OVERLAP_ENGINES:
        pairwise = np.array([[len(a & b) if i != j else len(a) for j, b in enumerate(sets)]
                             for i, a in enumerate(sets)], dtype=np.int64)
    return Overlap(tuple(e.name for e in fleet.engines), tuple(len(s) for s in sets), held, pairwise,
                   fleet.shared_blocks), sets


def elsewhere(sets: list[set], index: int) -> set:
    """Hashes some other engine holds on GPU."""
    others: set = set()
    for i, hashes in enumerate(sets):
        if i != index:
            others |= hashes
    return others


def _same_epoch(previous: EngineForest | None, engine: EngineSnapshot) -> bool:
    if previous is None or previous.engine.name != engine.name:
        return False
    a, b = previous.engine.counters, engine.counters
    return a.epoch == b.epoch and a.last_seq is not None and b.last_seq is not None and a.last_seq <= b.last_seq


def _media_classes(tiers) -> tuple[list[str], list[ColourClass], np.ndarray]:
    """The colour classes, one per medium, GPU first; and each tier's class."""
    media: list[str] = []
    for tier in sorted(tiers, key=lambda t: (t.medium != GPU, t.index)):
        if tier.medium not in media:
            media.append(tier.medium)
    classes = [ColourClass(m[:24], medium_color(m, i)) for i, m in enumerate(media)]
    return media, classes, np.array([media.index(t.medium) for t in tiers] or [0], dtype=np.uint8)


def _hash_index(cols, tiers, live: np.ndarray, tier_of: np.ndarray) -> dict:
    """(medium, group) -> hash -> snapshot row. Built from the snapshot's own tuple, with no list of a million
    hashes on the way (a list is traversed by every full garbage collection while it lives; the tuple, once,
    then untracked)."""
    if len(tiers) == 1:
        slots = _index(cols.hashes, range(len(cols.hashes)))
        slots.pop(None, None)  # the free rows
        return {(tiers[0].medium, tiers[0].group): slots}
    index = {}
    for tier in tiers:
        rows = live[tier_of == tier.index].tolist()
        index[(tier.medium, tier.group)] = _index(_pick(cols.hashes, np.asarray(rows, np.int64)), rows)
    return index


def _flags(engine: EngineSnapshot, index: dict, inverse: np.ndarray, live: np.ndarray, tier_of: np.ndarray,
           since: int | None, shared: set | None) -> np.ndarray:
    """Each live row's marks: stored after `since` (NEWEST), hot, held on GPU by another engine (SHARED)."""
    flags = np.zeros(len(live), np.uint8)

    def mark(entries, flag: int) -> None:
        for entry in entries:
            slot = index.get((entry.medium, entry.group), {}).get(entry.hash)
            if slot is not None:
                flags[inverse[slot]] |= flag

    if since is not None:
        mark((r for r in engine.recent_stored if r.seq > since), NEWEST)
    mark(engine.hot, HOT)
    if shared and (blocks := engine.blocks) is not None:
        gpu_tiers = [t.index for t in engine.tiers if t.medium == GPU]
        gpu_rows = np.flatnonzero(np.isin(tier_of, gpu_tiers))
        held = np.array([blocks.hashes[s] in shared for s in live[gpu_rows].tolist()], dtype=bool)
        flags[gpu_rows[held]] |= SHARED
    return flags


def _ghosts(engine: EngineSnapshot, previous: EngineForest, index: dict, since: int) -> list[Ghost]:
    """Blocks removed since the previous frame, which held them (drawn once more, marked removed)."""
    ghosts, seen = [], set()
    for r in engine.recent_removed:
        key = (r.medium, r.group)
        if r.seq <= since or (key, r.hash) in seen or r.hash in index.get(key, {}):
            continue
        slot = previous.index.get(key, {}).get(r.hash)
        if slot is None:
            continue
        seen.add((key, r.hash))
        old = previous.engine.blocks
        if old is None:  # (a frame whose index holds the hash was drawn from its blocks)
            continue
        ghosts.append(Ghost(key, r.hash, old.parents[slot], int(old.block_size[slot]), int(old.seq[slot]),
                            float(old.ts[slot]), old.tokens[slot], r.seq, r.ts))
    return ghosts


def build_forest(engine: EngineSnapshot, previous: EngineForest | None = None, shared: set | None = None,
                 detokenizer: Detokenizer | None = None, position: int | None = None) -> EngineForest:
    """The forest rows of `engine` (a snapshot with blocks); `previous`: the last frame's (for the marks of what
    changed since); `shared`: hashes other engines hold on GPU."""
    cols = engine.blocks
    if cols is None:
        raise ValueError("the forest needs a snapshot taken with blocks=True")
    live = np.flatnonzero(cols.resident)
    n = len(live)
    tiers = engine.tiers
    tier_of = cols.tier[live].astype(np.int64)
    inverse = np.full(len(cols.resident), -1, np.int64)
    inverse[live] = np.arange(n)
    parent_slot = cols.parent_row[live].astype(np.int64)
    parent = np.where(parent_slot >= 0, inverse[np.maximum(parent_slot, 0)], -1)

    media, classes, class_of_tier = _media_classes(tiers)
    colour = class_of_tier[tier_of] if n else np.zeros(0, np.uint8)
    index = _hash_index(cols, tiers, live, tier_of)
    last_seq = engine.counters.last_seq
    continuing = _same_epoch(previous, engine)
    since = (previous.engine.counters.last_seq if continuing and previous is not None
             else (last_seq - 1 if last_seq is not None else None))
    flags = _flags(engine, index, inverse, live, tier_of, since, shared)
    ghosts = _ghosts(engine, previous, index, since) if continuing and previous is not None and since is not None \
        else []
    ghost_index = {(g.tier, g.hash): n + k for k, g in enumerate(ghosts)}

    def find(block_hash: Any, tier: tuple) -> int:
        """The row holding `block_hash`: in `tier` first, then on GPU, then anywhere; ghosts too."""
        slot = index.get(tier, {}).get(block_hash)
        if slot is not None:
            return int(inverse[slot])
        row = ghost_index.get((tier, block_hash))
        if row is not None:
            return row
        for key in sorted(index, key=lambda k: k[0] != GPU):
            slot = index[key].get(block_hash)
            if slot is not None:
                return int(inverse[slot])
        return -1

    # roots whose parent hash is held elsewhere (another medium, or a ghost) hang under it
    tier_keys = [(t.medium, t.group) for t in tiers]
    roots = np.flatnonzero(parent < 0)
    if roots.size and (len(tiers) > 1 or ghosts):
        for row, parent_hash in zip(roots.tolist(), _pick(cols.parents, live[roots])):
            if parent_hash is not None:
                parent[row] = find(parent_hash, tier_keys[tier_of[row]])
    order = np.minimum(cols.seq[live], ORDER_SHIFT - 1) + tier_of * ORDER_SHIFT
    tokens = cols.block_size[live].astype(np.int64)
    if ghosts:
        for g in ghosts:
            if g.tier[0] not in media:
                media.append(g.tier[0])
                classes.append(ColourClass(g.tier[0][:24], medium_color(g.tier[0], len(media) - 1)))
        g_parent = np.array([find(g.parent, g.tier) if g.parent is not None else -1 for g in ghosts], np.int64)
        parent = np.concatenate((parent, g_parent))
        tokens = np.concatenate((tokens, [g.block_size for g in ghosts]))
        colour = np.concatenate((colour, np.array([media.index(g.tier[0]) for g in ghosts], np.uint8)))
        flags = np.concatenate((flags, np.full(len(ghosts), REMOVED, np.uint8)))
        order = np.concatenate((order, [min(g.seq, ORDER_SHIFT - 1) + ORDER_SHIFT * len(tiers) for g in ghosts]))
    hot = {(h.medium, h.group, h.hash): h for h in engine.hot}
    text = _Texts(engine, cols, live, tier_keys, tier_of, parent, flags, ghosts, hot, detokenizer)
    rows = ForestRows(parent=parent, tokens=tokens, colour=colour, flags=flags, order=order.astype(np.int64),
                      classes=tuple(classes), key=text.key, describe=text.describe, label=text.label)
    return EngineForest(rows, engine, live, index, inverse, tuple(ghosts), position)


class _Texts:
    """Keys, hover texts and labels of one forest's rows, made on demand (a hover, a label drawn)."""

    def __init__(self, engine, cols, live, tier_keys, tier_of, parent, flags, ghosts, hot, detokenizer):
        self.engine, self.cols, self.live = engine, cols, live
        self.tier_keys, self.tier_of, self.parent, self.flags = tier_keys, tier_of, parent, flags
        self.ghosts, self.hot, self.detokenizer = ghosts, hot, detokenizer
        self.n = len(live)

    def key(self, row: int) -> tuple:
        """(medium, group, hash)"""
        if row < self.n:
            medium, group = self.tier_keys[self.tier_of[row]]
            return medium, group, self.cols.hashes[int(self.live[row])]
        g = self.ghosts[row - self.n]
        return g.tier[0], g.tier[1], g.hash

    def _tokens(self, row: int) -> list[int]:
        if row < self.n:
            data = self.cols.tokens[int(self.live[row])]
        else:
            data = self.ghosts[row - self.n].tokens
        return np.frombuffer(data or b"", dtype="<u4")[:MAX_TEXT_TOKENS].tolist()

    def _text(self, ids: list[int]) -> str | None:
        if self.detokenizer is None or not ids:
            return None
        try:
            return self.detokenizer(ids)
        except Exception as error:  # noqa: BLE001 - a tokenizer failing on odd ids must not break a hover
            return f"(text unavailable: {type(error).__name__})"

    def label(self, row: int) -> str:
        text = self._text(self._tokens(row))
        if text is not None:
            return " ".join(text.split())[:60] or "·"
        return short_hash(self.key(row)[2])

    def describe(self, row: int) -> str:
        medium, group, block_hash = self.key(row)
        where = medium if group is None else f"{medium}, group {group}"
        lines = [f"block {format_hash(block_hash)}  ({where})"]
        if row < self.n:
            slot = int(self.live[row])
            parent_hash, size = self.cols.parents[slot], int(self.cols.block_size[slot])
            seq, ts, extras = int(self.cols.seq[slot]), float(self.cols.ts[slot]), self.cols.extras[slot]
        else:
            g = self.ghosts[row - self.n]
            parent_hash, size, seq, ts, extras = g.parent, g.block_size, g.seq, g.ts, None
        if parent_hash is None:
            lines.append("parent: none (the first block of a prefix)")
        else:
            held = "" if self.parent[row] >= 0 else "  (not resident)"
            lines.append(f"parent: {format_hash(parent_hash)}{held}")
        ids = self._tokens(row)
        shown = " ".join(map(str, ids[:32])) + (" …" if len(ids) > 32 else "")
        lines.append(f"{size} tokens: {shown}")
        text = self._text(ids)
        if text is not None:
            lines.append(f"text: {text!r}")
        last_ts = self.engine.counters.last_ts
        age = f", {last_ts - ts:.3g} s before the last batch" if last_ts is not None and math.isfinite(ts) else ""
        lines.append(f"stored by seq {seq} at {format_ts(ts)}{age}")
        flags = int(self.flags[row])
        if flags & REMOVED:
            g = self.ghosts[row - self.n]
            lines.append(f"REMOVED by seq {g.removed_seq} at {format_ts(g.removed_ts)} (shown for this frame)")
        if flags & NEWEST:
            lines.append("newest: stored since the last frame")
        hot = self.hot.get((medium, group, block_hash))
        if hot is not None:
            lines.append(f"hot: stored again {hot.restores}× soon after a removal (last {hot.last_gap_s:.3g} s after)")
        if flags & SHARED:
            lines.append("another engine holds it on GPU too")
        if extras:
            lines.append(", ".join(f"{k}: {v}" for k, v in extras.items())[:300])
        return "\n".join(lines)


# --- series -----------------------------------------------------------------------------------------------
def nice_step(value: float) -> float:
    """The smallest of 1, 2, 5 × 10^k that is >= value."""
    if not value > 0 or not math.isfinite(value):
        return 1.0
    exponent = 10.0 ** math.floor(math.log10(value))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * exponent >= value * (1 - 1e-9):
            return m * exponent
    return 10 * exponent


@dataclass(frozen=True)
class Rates:
    """Blocks stored and removed per second, in time bins ending at the last batch (x: seconds, ≤ 0)."""

    x: np.ndarray
    stored: np.ndarray
    removed: np.ndarray
    bin_s: float
    resident_x: np.ndarray  # per batch: resident blocks after it
    resident: np.ndarray


def rates(history: History, bins: int = 240) -> Rates:
    ts = history.ts
    if not len(ts):
        z = np.zeros(0)
        return Rates(z, z, z, 1.0, z, z)
    t = ts - ts[-1]
    t = np.where(np.isfinite(t), t, 0.0)
    start = float(t.min())
    gaps = np.diff(t)
    typical = float(np.median(gaps)) if gaps.size else 0.0  # a bin holds a batch or more: no comb of empty bins
    width = nice_step(max(-start / bins, typical, 1e-3))
    first = math.ceil(start / width - 1e-9)
    index = np.ceil(t / width - 1e-9).astype(np.int64) - first  # bin k holds (end - width, end]; the last ends at 0
    count = int(index.max()) + 1
    stored = np.bincount(index, weights=history.stored, minlength=count) / width
    removed = np.bincount(index, weights=history.removed, minlength=count) / width
    x = (np.arange(count) + first) * width  # each bin's end
    return Rates(x, stored, removed, width, t, history.resident.astype(np.float64))


def lifetime_histogram(lifetimes: np.ndarray, per_decade: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Counts in log-spaced bins: (edges in log10 seconds, counts); lifetimes under 1 ms count as 1 ms."""
    values = np.asarray(lifetimes, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not values.size:
        return np.zeros(0), np.zeros(0)
    logs = np.log10(np.maximum(values, 1e-3))
    lo = math.floor(logs.min() * per_decade) / per_decade
    hi = max(math.ceil(logs.max() * per_decade) / per_decade, lo + 1 / per_decade)
    if logs.max() >= hi:
        hi += 1 / per_decade
    edges = np.arange(lo, hi + 1e-9 + 1 / per_decade, 1 / per_decade)
    counts, _ = np.histogram(logs, edges)
    return edges, counts.astype(np.float64)


@dataclass(frozen=True)
class HotRow:
    hash: str
    medium: str
    restores: int
    last_gap_s: float
    ago_s: float | None
    resident: bool
    text: str


def hot_rows(engine: EngineSnapshot, forest: EngineForest | None, detokenizer: Detokenizer | None,
             limit: int = 50) -> list[HotRow]:
    """The hot prefixes, most restores first; text from the forest frame when it holds the block."""
    rows = []
    last = engine.counters.last_ts
    for h in engine.hot[:limit]:
        row = forest.block_row(h.hash, h.medium, h.group) if forest is not None and forest.name == engine.name \
            else -1
        text = ""
        if row >= 0 and detokenizer is not None and forest is not None:
            try:
                text = " ".join(detokenizer(forest.tokens(row)[:64].tolist()).split())[:80]
            except Exception:  # noqa: BLE001 - see _Texts._text
                text = ""
        rows.append(HotRow(format_hash(h.hash), h.medium, h.restores, h.last_gap_s,
                           None if last is None else last - h.last_ts, row >= 0, text))
    return rows


def metric_series(samples: Sequence, t0: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """x (seconds since t0) and y per metric: running, waiting (requests), kv_usage, hit_rate (percent). A hit
    rate comes from two consecutive samples' counters (vLLM) or the engine's own gauge (SGLang)."""
    out: dict[str, tuple[list, list]] = {name: ([], []) for name in ("running", "waiting", "kv_usage", "hit_rate")}
    previous = None
    for sample in samples:
        x = sample.time - t0
        for name in ("running", "waiting"):
            value = getattr(sample, name)
            if value is not None:
                out[name][0].append(x)
                out[name][1].append(value)
        if sample.kv_usage is not None:
            out["kv_usage"][0].append(x)
            out["kv_usage"][1].append(100 * sample.kv_usage)
        rate = sample.hit_rate
        if previous is not None and None not in (previous.prefix_hits, previous.prefix_queries,
                                                 sample.prefix_hits, sample.prefix_queries):
            queries = sample.prefix_queries - previous.prefix_queries
            rate = (sample.prefix_hits - previous.prefix_hits) / queries if queries > 0 else None
        if rate is not None:
            out["hit_rate"][0].append(x)
            out["hit_rate"][1].append(100 * rate)
        previous = sample
    return {name: (np.array(x, dtype=np.float64), np.array(y, dtype=np.float64)) for name, (x, y) in out.items()}

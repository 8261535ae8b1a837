"""One decoding token of each of several sequences written into one layer in one call (KVCacheManager.append_many),
as one `append` per sequence in the same order writes them (eviction.append).

A token that needs only a slot — no eviction at its budget, no pruning, per-head masks or ThinK channels — has it
chosen and its table, policy statistics and event updated here, one sequence at a time in order: inlined where its
lowest empty slot lies in a page of its own that stands for no prefix hash (what `LayerManager.free_slot` then
`wrote` do there, without their calls: the common decode step), that slot known from the table's decode lane
(LayerTable.lane_next: no min over its hole set, whose entries it takes out only when someone reads `holes`, so a
decode step touches neither the set nor the policy), else through those two (a page allocated, or a
shared or registered page copied or forgotten first, as a single write does). The K/V, positions and
occupancy of all of them are then written by one store call (`PageStore.write_rows`: float32 RAM pages,
`store.in_place`). Any other token goes through `append_one(i)` at its turn, after the K/V held so far are
written, so every page, table, event and stored value is the single calls' (tests/test_batched_append.py). Each
sequence's newest position is set here too, at its turn (`append_many` set it after them all: no write reads it).
A batched decode step (KVCacheManager.decode_many) asks the held K/V not to be written here when every token was
held (`hold`): the batched attention's numba call writes them (batch_decode_kernel.attend_tables' `write`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagevis.kvcache.layer_managers import LayerManager
from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.sequence import LayerTable, SequenceCache

NEEDS_MORE, NO_HOLE = -1, -2  # _start_lane's answers that are no slot


def write_many(layer: LayerManager, seqs: list[SequenceCache], k: np.ndarray, v: np.ndarray, positions: np.ndarray,
               append_one: Callable[[int], None], hold: bool = False) -> np.ndarray | None:
    """k, v (B, n_kv_heads, head_dim), positions (B,) int64: sequence i's token; see the module docstring. hold: when
    every token took a slot here (none went through append_one), their K/V, positions, fills and bias are not
    written but their flat slots returned (B,), sequence i's token's at i, for the batched attention kernel's call to
    write (KVCacheManager.decode_many); else None, everything written."""
    store, tables, log, flats, rows = layer.store, layer.tables, layer.log, [], []
    windowed, can_allocate = layer.window is not None, store.pages.can_allocate
    ps, index, add_write = layer.page_size, layer.layer, log.add_write if log.writes else None
    shared, registered = store.pages.ref_counts, store.pages.frame_hash
    ints = positions.tolist()
    for i, seq in enumerate(seqs):
        position = ints[i]
        if position > seq.newest:  # (read by no write of this token: a local layer's slide takes `position`)
            seq.newest = position
        if windowed:
            log.acting = seq.seq_id
            layer.before_write(seq, position)
        table = tables[seq.seq_id]
        flat = table.lane_next  # (its lowest empty slot, known: LayerTable's decode lane)
        if not 0 <= flat < table.lane_end or table.resident >= table.lane_budget:
            flat = _start_lane(layer, seq, table)
        if flat >= 0 and shared[flat // ps] <= 1 and flat // ps not in registered:  # `free_slot`, `wrote` inlined
            state = table.state
            if type(state) is not PolicyState:  # (the base keeps no statistics)
                state.took(flat, k[i], v[i], position)
            table.lane_next = flat + 1
            table.resident += 1
            if position < table.floor:
                table.floor = -1
            if add_write is not None:
                add_write(seq.seq_id, index, flat // ps, flat % ps, position)
            flats.append(flat)
            rows.append(i)
            continue
        if flat >= 0 or (flat == NO_HOLE and can_allocate()):  # (a page allocated, or copied or forgotten first)
            log.acting = seq.seq_id
            allocates = flat == NO_HOLE
            flat = layer.free_slot(seq, table)
            layer.wrote(seq, table, flat, k[i], v[i], position)
            if allocates:  # (the new page's first slot: the lane runs on over the rest, with no min over them)
                table.resume_lane(flat + 1, flat + ps)
            flats.append(flat)
            rows.append(i)
            continue
        log.acting = seq.seq_id
        _write_held(layer, flats, rows, k, v, positions, ints)
        append_one(i)
    if seqs:
        log.acting = seqs[-1].seq_id
    if hold and seqs and len(rows) == len(seqs):  # (rows then is 0 .. B - 1: none went through append_one)
        layer.store.newest = max(layer.store.newest, max(ints))  # (PageStore.write_rows' own bookkeeping)
        return np.array(flats, np.int64)
    _write_held(layer, flats, rows, k, v, positions, ints)
    return None


def _start_lane(layer: LayerManager, seq: SequenceCache, table: LayerTable) -> int:
    """The sequence's lowest empty slot, its table's lane started there, when its token needs only a slot (no
    eviction at its budget, no pruning, per-head masks or ThinK channels); NO_HOLE when it has no empty slot, NEEDS_MORE
    when it needs more than a slot."""
    if table.head_keep is not None or seq.channels is not None or seq.policy.prunes:
        return NEEDS_MORE
    budget = layer.budget(seq)
    if table.resident >= budget:
        return NEEDS_MORE
    flat = table.start_lane(budget)
    return flat if flat >= 0 else NO_HOLE


def _write_held(layer: LayerManager, flats: list[int], rows: list[int], k: np.ndarray, v: np.ndarray,
                positions: np.ndarray, ints: list[int]) -> None:
    """The held tokens' K/V in one store call (ints: positions as a list)."""
    if flats:
        newest = max(ints) if len(rows) == len(ints) else max(ints[i] for i in rows)  # (commonly: every row)
        layer.store.write_rows(np.array(flats, np.int64), np.array(rows, np.int64), k, v, positions, newest)
        flats.clear()
        rows.clear()

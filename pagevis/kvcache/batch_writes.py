"""One decoding token of each of several sequences written into one layer in one call (KVCacheManager.append_many),
as one `append` per sequence in the same order writes them (eviction.append).

A token that needs only a slot — no eviction at its budget, no pruning, per-head masks or ThinK channels — has it
chosen (`LayerManager.free_slot`: a page allocated, or a shared page copied first, as a single write does) and its
table, policy statistics and event updated here (`LayerManager.wrote`), one sequence at a time in order; the K/V,
positions and occupancy of all of them are then written by one store call (`PageStore.write_rows`: float32 RAM
pages, `store.in_place`). Any other token goes through `append_one(i)` at its turn, after the K/V held so far are
written, so every page, table, event and stored value is the single calls' (tests/test_batched_append.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagevis.kvcache.layer_managers import LayerManager
from pagevis.kvcache.sequence import SequenceCache


def write_many(layer: LayerManager, seqs: list[SequenceCache], k: np.ndarray, v: np.ndarray, positions: np.ndarray,
               append_one: Callable[[int], None]) -> None:
    """k, v (B, n_kv_heads, head_dim), positions (B,) int64: sequence i's token; see the module docstring."""
    store, tables, log, held = layer.store, layer.tables, layer.log, []
    windowed, can_allocate = layer.window is not None, store.pages.can_allocate
    for i, (seq, position) in enumerate(zip(seqs, positions.tolist(), strict=True)):
        log.acting = seq.seq_id
        if windowed:
            layer.before_write(seq, position)
        table = tables[seq.seq_id]
        if (table.head_keep is None and seq.channels is None and not seq.policy.prunes
                and table.resident < layer.budget(seq) and (table.holes or can_allocate())):
            flat = layer.free_slot(seq, table)
            layer.wrote(seq, table, flat, k[i], v[i], position)
            held.append((i, flat))
        else:
            _write_held(layer, held, k, v, positions)
            append_one(i)
    _write_held(layer, held, k, v, positions)


def _write_held(layer: LayerManager, held: list[tuple[int, int]], k: np.ndarray, v: np.ndarray,
                positions: np.ndarray) -> None:
    if held:
        rows, flats = zip(*held)
        layer.store.write_rows(np.array(flats, np.int64), np.array(rows, np.int64), k, v, positions)
        held.clear()

"""Attention over a sequence's pages in one layer: which keys it reads and how (the kernels are attention_kernels.py's).

- A single live sequence in RAM reads the pool's used prefix in place (no gather), unless its layer prefers
  to gather (a sliding window far above the pool's bottom); with several sequences, each reads its own pages
  through its block table (`attend`: where they lie, a decode query through batch_decode_kernel, a chunk through
  chunk_kernel; gathered when a policy reads every query's weights or heads keep their own tokens), or, decoding
  one token each, all at once (`attend_many`), or, a step's chunks of several queries beside them, all at once
  too, where they lie (`attend_chunks`).
- With a disk tier, a quantized dtype or Quest's page selection, through the reader (reader.py).
- A per-head policy's masks: each KV head reads only the tokens it keeps (`attend_kept`).
- kvzip's reconstruction pass reads the cache beside tokens that are not written (`attend_beside`).

The layer's manager (layer_managers.py) masks what its kind of layer does not see (a sliding window). The policy's
statistics see the queries and the weights (`uses_queries`, `uses_attention`), and ThinK its query window.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pagevis.kernel_loader import import_kernels
from pagevis.kvcache import attention_kernels as kernels, eviction
from pagevis.kvcache.attention_kernels import DECODE_DTYPES, AttentionResult, attend_decode_batch
from pagevis.kvcache.layer_managers import LayerManager, own_hole
from pagevis.kvcache.policy_state import PolicyState
from pagevis.kvcache.policies.lazy_kernels import kernels as kernels_of_policies
from pagevis.kvcache.reader import read_attention
from pagevis.kvcache.sequence import SequenceCache
from pagevis.kvcache.slots import flat_slots


def _no_pool() -> Any:
    return None


# The weights' second thread (model/spin_pool.py's pool, or None on one thread), as a function the engine hands in
# (share_pool: the cache imports no model); batched decode attention shares its sequences with it, a lone sequence's
# decode attention its keys.
_pool: Callable[[], Any] = _no_pool


def share_pool(pool: Callable[[], Any]) -> None:
    """Batched decode attention (`attend_stacked`) shares its sequences with pool()'s helper thread when it gives
    one (model.quantized.spin_pool: None on one weight thread), and a lone sequence's decode its keys' parts
    (attention_kernels.attend_decode)."""
    global _pool
    _pool = pool


def attend(layer: LayerManager, seq: SequenceCache, q: np.ndarray, positions: np.ndarray,
           select_pages: int | None, write: tuple[int, np.ndarray, np.ndarray] | None = None,
           all_weights: bool = True) -> AttentionResult:
    """Attention of the sequence's n queries (n, n_heads, head_dim) at `positions` over its resident
    tokens. Weights come back over flat slots: the pool's allocated prefix when `slots` is None (a
    single sequence in RAM), else over `result.slots`; exactly 0 on empty slots; every query's, or with
    `all_weights` False only the last query's (1, n_heads, m) unless the policy's statistics read them all (a
    long prefill's weights are then never whole in memory: attention_kernels.query_block). write: (flat, k, v), a
    decoding token's K/V that the decode kernel writes into slot flat first (`write_and_attend`, which calls only
    where that in-place decode call is the path taken)."""
    store, index, own = layer.store, layer.layer, layer.table(seq)
    if store.tiered or store.quantized or (select_pages is not None and len(q) == 1):
        return read(layer, seq, q, positions, select_pages)
    own.read_slots = None
    observe_queries(seq, own.state, index, q, positions)
    all_weights = all_weights or seq.policy.uses_attention
    n_kv, _, ps, head_dim = store.k.shape
    keep = own.head_keep
    read_slots: slice | np.ndarray  # the slots weighed: the pool's used prefix in place, else the table's
    through_table = keep is None and store.k.dtype in DECODE_DTYPES and bool(own.pages)
    if len(q) > 1 and through_table and not all_weights:
        # a chunk (its last query's weights only): through its block table, the pages read where they lie, in the
        # chunk kernel however many sequences share the pool, as a step of several sequences' chunks takes it
        # (attend_chunks), so a prompt's K/V are the same bits alone or beside others (a prefix cache holds one)
        result, read_slots = _through_table(layer, own, q, positions)
    elif len(layer.tables) == 1 and not layer.gathers(seq):  # the only owner: the pool's used prefix, in place
        n_slots = store.high_water * ps
        # With no empty slot below the high-water mark the occupancy mask is all zeros: skip it.
        bias = None if own.resident == n_slots else store.bias[:n_slots]
        read_slots = slice(0, n_slots)
        if len(q) == 1 and store.k.dtype in DECODE_DTYPES and n_slots:  # decode: one kernel call, per-head masks or not
            result = kernels.attend_decode(q, store.k_rows, store.v_rows, n_slots,
                                           bias if keep is None else kept_bias(keep[:, :n_slots], bias),
                                           store.positions, int(positions[0]), layer.window, write, _pool())
        else:
            keys = store.k[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
            values = store.v[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
            result = attend_kept(q, keys, values, bias, store.positions[:n_slots], positions,
                                 None if keep is None else keep[:, read_slots], layer.window, all_weights)
    elif len(q) == 1 and through_table:
        # decode through its block table, the pages read where they lie (no gather copy): a sole sequence in a pool
        # aged by cached pages (the server's one client), or one of several outside a batched step
        result, read_slots = _through_table(layer, own, q, positions)
    else:  # gathered through its block table
        table = own.pages
        keys = store.k[:, table].reshape(n_kv, len(table) * ps, head_dim)
        values = store.v[:, table].reshape(n_kv, len(table) * ps, head_dim)
        read_slots = flat_slots(table, ps)
        bias = store.bias[read_slots]
        result = attend_kept(q, keys, values, bias if bias.any() else None, store.positions[read_slots], positions,
                             None if keep is None else keep[:, read_slots], layer.window, all_weights)
        result = result._replace(slots=read_slots)
    if seq.policy.uses_attention:
        own.state.observe(result.weights, read_slots)
    return result


def _through_table(layer: LayerManager, own: Any, q: np.ndarray, positions: np.ndarray
                   ) -> tuple[AttentionResult, np.ndarray]:
    """`attend` of one sequence's queries through its block table (own: its LayerTable), the pages read where they
    lie: one query in the batched decode kernel, several (their last one's weights only) in the chunk kernel; and the
    table's flat slots, which the weights are over (result.slots)."""
    store, table, window = layer.store, own.pages, layer.window or 0
    tables, counts = np.array([table], np.int64), np.array([len(table)], np.int64)
    if len(q) == 1:
        output, weights = kernels.batch_decode_kernels().attend_tables(
            q, store.k, store.v, tables, counts, store.bias, store.positions, positions, window)
    else:
        output, weights = chunk_kernels().attend_chunks(q, store.k, store.v, tables, counts, store.bias, store.positions,
                                                        positions, np.array([0, len(q)], np.int64), window, _pool(), (0,))
    slots = flat_slots(table, layer.page_size)
    return AttentionResult(output, weights, slots), slots


def write_and_attend(layer: LayerManager, seq: SequenceCache, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     positions: np.ndarray) -> AttentionResult | None:
    """A decode step's `append` and `attend` (one token: q (1, n_heads, d), k, v (n_kv, d) at positions (1,)) in one
    kernel call that writes the token's K/V into its slot and attends over the pool's used prefix in place, where
    nothing else is due: the layer's only sequence, float RAM pages (`store.in_place`), no ThinK channels or
    pruning, room under its budget in a page of its own (`own_hole`), no gathering; its policy's statistics
    see the token and the weights as `attend` gives them. None when any of that does not hold, before anything
    changed but a sliding window's slide and a per-head policy's drops (`before_write`, then `evict_heads`, which
    `append` does first too, and which then drops nothing more): append and attend then. (No page selection
    either: the caller asks only without one.)"""
    store, own, position = layer.store, layer.tables[seq.seq_id], int(positions[0])
    if not store.in_place or len(layer.tables) != 1 or seq.channels is not None or seq.policy.prunes:
        return None
    layer.before_write(seq, position)
    if own.head_keep is not None:  # a per-head policy's drops before the token is written (as eviction.append)
        eviction.evict_heads(layer, seq)
    if own.resident >= layer.budget(seq) or layer.gathers(seq):
        return None
    flat = own_hole(layer, own)
    if flat is None:
        return None
    layer.wrote(seq, own, flat, k, v, position)
    store.mark_written(flat, flat // store.page_size, flat // store.page_size, flat % store.page_size, position)
    return attend(layer, seq, q, positions, None, (flat, k, v))


def observe_queries(seq: SequenceCache, state: PolicyState, layer: int, q: np.ndarray, positions: np.ndarray) -> None:
    """The queries a layer attends with, to the policy's statistics there if it reads them and to ThinK's window."""
    if seq.policy.uses_queries:
        state.query(q, positions)
    if seq.channels is not None:
        seq.channels.observe(layer, q)


def read(layer: LayerManager, seq: SequenceCache, q: np.ndarray, positions: np.ndarray,
         select_pages: int | None) -> AttentionResult:
    """Attention through the reader: pages on disk, or a page selection (a chunk of several
    queries reads every page: max_chunk keeps such chunks within select_pages pages)."""
    index, own = layer.layer, layer.table(seq)
    observe_queries(seq, own.state, index, q, positions)
    result = read_attention(layer.store, own.pages, q, positions, layer.log.step,
                            select_pages if len(q) == 1 else None,
                            all_weights=seq.policy.uses_attention and len(q) > 1,
                            own_pages_only=len(layer.tables) > 1, keep=own.head_keep, window=layer.window)
    own.read_slots = slots = result.slots
    if seq.policy.uses_attention and slots is not None:  # (the reader always says which slots it read)
        own.state.observe(result.weights, slots)
    return result


def attend_beside(layer: LayerManager, seq: SequenceCache, q: np.ndarray, positions: np.ndarray, k: np.ndarray,
                  v: np.ndarray, own_positions: np.ndarray) -> AttentionResult:
    """Attention of queries whose tokens are not cached (kvzip's reconstruction pass) over the sequence's
    resident tokens and the given ones (k, v: (m, n_kv_heads, head_dim) at own_positions, seen causally);
    nothing is written, and the policy's statistics see the weights on the cached tokens only through
    `reconstruct`. Weights over the read slots, then the given tokens; result.slots: the read slots. RAM
    pages of float K/V only."""
    store, own = layer.store, layer.table(seq)
    table = own.pages
    n_kv, _, _, head_dim = store.k.shape
    read_slots = layer.flat(seq)
    keys = np.concatenate([store.k[:, table].reshape(n_kv, len(read_slots), head_dim), k.transpose(1, 0, 2)], axis=1)
    values = np.concatenate([store.v[:, table].reshape(n_kv, len(read_slots), head_dim), v.transpose(1, 0, 2)],
                            axis=1)
    bias = np.concatenate([store.bias[read_slots], np.zeros(len(own_positions), dtype=np.float32)])
    keep = own.head_keep
    if keep is not None:
        keep = np.concatenate([keep[:, read_slots], np.ones((n_kv, len(own_positions)), dtype=bool)], axis=1)
    result = attend_kept(q, keys, values, bias, np.concatenate([store.positions[read_slots], own_positions]),
                         positions, keep, layer.window)
    own.state.reconstruct(result.weights[..., : len(read_slots)], read_slots)
    return result._replace(slots=read_slots)


def can_attend_many(layer: LayerManager, seqs: list[SequenceCache], select_pages: int | None) -> bool:
    """Whether `attend_many` serves these sequences: several of them in a shared pool, pages in RAM and
    unquantized, no page selection, no per-head residency."""
    store = layer.store
    return (len(seqs) > 1 and len(layer.tables) > 1 and not (store.tiered or store.quantized)
            and select_pages is None and all(layer.tables[seq.seq_id].head_keep is None for seq in seqs))


def attend_many(layer: LayerManager, seqs: list[SequenceCache], q: np.ndarray, positions: np.ndarray
                ) -> list[AttentionResult]:
    """`attend` for several sequences that each decode one token (q: (B, n_heads, d), positions (B,)),
    in one batched kernel over their block tables, padded to the longest. Only where `can_attend_many`."""
    _, results = attend_stacked(layer, seqs, q, positions, range(len(seqs)))
    return [results[i] for i in range(len(seqs))]


def attend_stacked(layer: LayerManager, seqs: list[SequenceCache], q: np.ndarray, positions: np.ndarray,
                   wanted, write: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, dict[int, AttentionResult]]:
    """`attend_many`'s output as one (B, n_heads, d) array, and the AttentionResult of the rows in `wanted` only
    (indices: a decode step's watched sequences), so a step builds no per-sequence result nobody reads. write: (flats,
    k, v), the decoding tokens batch_writes.write_many held for the kernel (float RAM pages: `store.in_place`), which
    writes them into their slots as PageStore.write_rows does before it reads them (batch_decode_kernel's
    attend_tables)."""
    store, index, ps, of = layer.store, layer.layer, layer.page_size, layer.tables
    owns = [of[seq.seq_id] for seq in seqs]
    tables = [own.pages for own in owns]
    counts = [len(table) for table in tables]
    built = set(wanted)  # the rows whose AttentionResult is made
    for i, seq in enumerate(seqs):
        owns[i].read_slots = None
        policy = seq.policy
        if policy.uses_queries or seq.channels is not None:
            observe_queries(seq, owns[i].state, index, q[i: i + 1], positions[i: i + 1])
        if policy.uses_attention:
            built.add(i)
    widest = max(counts)
    padded, n_pages = _padded(tables, counts, widest)
    if store.k.dtype in DECODE_DTYPES:  # K/V read in place through the tables, the bias and the window's mask per slot
        output, weights = kernels.batch_decode_kernels().attend_tables(  # (layer.mask's), one numba call
            q, store.k, store.v, padded, n_pages, store.bias, store.positions, positions, layer.window or 0,
            _pool(), None if write is None else (*write, store.fill))
    else:
        assert write is None  # (only float RAM pages hold tokens back for the kernel)
        flat = flat_slots(padded, ps)
        bias = store.bias[flat]
        bias[np.arange(widest * ps)[None, :] >= n_pages[:, None] * ps] = -np.inf  # the padding
        layer.mask(bias, store.positions[flat], positions)
        n_kv, _, _, head_dim = store.k.shape
        keys = store.k[:, padded].reshape(n_kv, len(seqs), widest * ps, head_dim)
        values = store.v[:, padded].reshape(n_kv, len(seqs), widest * ps, head_dim)
        output, weights = attend_decode_batch(q, keys, values, bias)
    results = {}
    for i in sorted(built):
        slots = flat_slots(tables[i], ps)
        result = results[i] = AttentionResult(output[i: i + 1], weights[i: i + 1, :, :len(slots)], slots)
        if seqs[i].policy.uses_attention:
            owns[i].state.observe(result.weights, slots)
    return output, {i: results[i] for i in wanted}


# A step's chunks in one kernel call where `can_attend_chunks` (False: each sequence its own `attend`, as before:
# the tests' and the benches' A/B, not a setting)
CHUNKS_IN_ONE_CALL = True


def can_attend_chunks(layer: LayerManager, seqs: list[SequenceCache], select_pages: int | None) -> bool:
    """Whether `attend_chunks` serves these sequences: `attend`'s gathered path for each (several in a shared pool)
    over float RAM pages (`store.in_place`), with no page selection, per-head residency or ThinK channels, and no
    policy whose statistics read every query's weights (`uses_attention`: `attend` gives it them); not in a sliding
    window's layer, which lets go of a chunk's pages below the window once it attended (`attended`), before the next
    sequence's append may take them: one call after every append would change which pages those get."""
    return (CHUNKS_IN_ONE_CALL and len(seqs) > 1 and len(layer.tables) > 1 and layer.store.in_place
            and not layer.window and select_pages is None
            and all(layer.tables[seq.seq_id].head_keep is None and seq.channels is None
                    and not seq.policy.uses_attention for seq in seqs))


def chunk_kernels() -> Any:
    """chunk_kernel.py (several sequences' chunks of queries through their block tables in one call), imported on
    first use through kernel_loader.import_kernels."""
    return import_kernels("pagevis.kvcache.chunk_kernel", "the chunked attention kernels")


Chunked = tuple[np.ndarray, dict[int, AttentionResult]] | None  # every row's output, the wanted ones' results; or None


def attend_chunks(layer: LayerManager, seqs: list[SequenceCache], q: np.ndarray, positions: np.ndarray,
                  starts: np.ndarray, wanted=(), select_pages: int | None = None) -> Chunked:
    """`attend` of each sequence's rows (sequence i's: rows starts[i] .. starts[i + 1] of q (N, n_heads, d), at
    positions (N,); their K/V appended), in one kernel call over their block tables (chunk_kernel.attend_chunks):
    every row's output as one (N, n_heads, d) array, and the AttentionResult of the sequences in `wanted` (indices:
    a step's watched ones) with their last row's weights (as `attend(..., all_weights=False)` keeps them) over their
    flat slots. None (nothing done) where not `can_attend_chunks`: each sequence's `attend` then. (No sliding
    window's layer: no `attended` is due after a chunk.)"""
    if not can_attend_chunks(layer, seqs, select_pages):
        return None
    index, ps, of = layer.layer, layer.page_size, layer.tables
    owns = [of[seq.seq_id] for seq in seqs]
    tables = [own.pages for own in owns]
    counts = [len(table) for table in tables]
    for i, seq in enumerate(seqs):
        owns[i].read_slots = None
        if seq.policy.uses_queries:
            observe_queries(seq, owns[i].state, index, q[starts[i]: starts[i + 1]], positions[starts[i]: starts[i + 1]])
    padded, n_pages = _padded(tables, counts, max(counts))
    store = layer.store
    output, weights = chunk_kernels().attend_chunks(q, store.k, store.v, padded, n_pages, store.bias, store.positions,
                                                    positions, starts, layer.window or 0, _pool(), wanted)
    results = {}
    for w, i in enumerate(wanted):
        slots = flat_slots(tables[i], ps)
        results[i] = AttentionResult(output[starts[i]: starts[i + 1]], weights[w: w + 1, :, :len(slots)], slots)
    return output, results


_last_padded: tuple[list[list[int]], np.ndarray, np.ndarray] = ([], np.zeros((0, 0), np.int64), np.zeros(0, np.int64))


def _padded(tables: list[list[int]], counts: list[int], widest: int) -> tuple[np.ndarray, np.ndarray]:
    """The block tables as one (B, widest) array, each padded with page 0, and their lengths: the last call's arrays
    again (never written) when the tables are the same (a step's layers commonly hold the same page ids: each layer's
    pool allocates in the same order)."""
    global _last_padded
    last = _last_padded
    if tables == last[0]:
        return last[1], last[2]
    padded = np.zeros((len(tables), widest), np.int64)
    if min(counts) == widest:
        padded[:] = tables
    else:
        for row, table in zip(padded, tables, strict=True):
            row[: len(table)] = table
    n_pages = np.array(counts, np.int64)
    _last_padded = ([list(table) for table in tables], padded, n_pages)
    return padded, n_pages


def attend_kept(q: np.ndarray, keys: np.ndarray, values: np.ndarray, bias: np.ndarray | None,
                key_positions: np.ndarray, positions: np.ndarray, keep: np.ndarray | None,
                window: int | None = None, all_weights: bool = True) -> AttentionResult:
    """`attend`, where KV head h reads only the keys with keep[h] (per-head residency; None: all keys for
    every head). When some head dropped a resident token, each KV head's mask is added to the occupancy bias (-inf
    on dropped entries): a decode query over float32 or float16 keys takes every head's in one decode kernel call
    (its bias one row a KV head); otherwise each KV head's queries attend alone, joined in query-head order.
    all_weights: kernels.attend's (False: the last query's only)."""
    head_bias = bias if keep is None else kept_bias(keep, bias)
    # no head differs, or the decode kernel's: one call
    if head_bias is None or head_bias.ndim == 1 or kernels.takes_decode_kernel(q, keys, values):
        return kernels.attend(q, keys, values, head_bias, key_positions, positions, window, all_weights)
    n_kv = keys.shape[0]
    group = q.shape[1] // n_kv
    outputs, weights = [], []
    for head in range(n_kv):
        part = kernels.attend(q[:, head * group: (head + 1) * group], keys[head: head + 1], values[head: head + 1],
                              head_bias[head], key_positions, positions, window, all_weights)
        outputs.append(part.output)
        weights.append(part.weights)
    return AttentionResult(np.concatenate(outputs, axis=1), np.concatenate(weights, axis=1))


def kept_bias(keep: np.ndarray, bias: np.ndarray | None) -> np.ndarray | None:
    """The occupancy bias with each KV head's mask added (keep (n_kv, n): -inf where a head dropped the slot), one
    row a KV head; `bias` itself when no head differs (each slot kept by every head or by none)."""
    head_bias = kernels_of_policies().head_mask_bias(keep, bias)  # one numba call (policies/kernels.py)
    return bias if head_bias.size == 0 else head_bias

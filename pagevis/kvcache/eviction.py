"""Writing a sequence's tokens into one layer (`append`), and eviction: what the cache does with a policy's
choices there.

The policy chooses (policies/): whole tokens when the layer is at its budget (`evict`, N at once for periodic
compression), tokens under a threshold before every write (`prune`), (KV head, token) entries for a per-head
policy (`evict_heads`, and kvzip's one-shot `compress`); a merging policy also names the survivor each victim's
value folds into (`merge`). Here the choice is carried out by the layer's manager (layer_managers.py), which owns
the sequence's table there, through its named operations: `write` a token, `evict` tokens, `drop_entries` (a
per-head policy's masks), and its `rewrites` (rewrites.py): `fold_values` (a merge's survivors), `rotate_keys`
(re-rotation, asked by the policy's wrapper: wrappers.py), `prune_key_channels` (ThinK). Each asks `LayerManager.writable` for every page it changes
(a shared page is copied and keeps its prefix hash; a page changed in place leaves the prefix cache), releases a
page left empty and records every change as an event; then the policy hears of the removal (`after_removal`).
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.errors import CacheFullError
from pagevis.kvcache.layer_managers import LayerManager, own_hole
from pagevis.kvcache.sequence import SequenceCache


def append(layer: LayerManager, seq: SequenceCache, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
    """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions into the sequence's own
    pages, evicting (its policy) at its budget and copying any shared page before changing it."""
    store, index, policy = layer.store, layer.layer, seq.policy
    if store.kivi:
        layer.rewrites.seal_residual(seq, len(positions))
    if len(positions):
        layer.before_write(seq, int(positions[0]))
    table = layer.table(seq)
    holes, keep = table.holes, table.head_keep
    budget = layer.budget(seq)
    if seq.channels is not None:
        k = seq.channels.prune(index, k)
    if len(positions) == 1 and keep is None and not policy.prunes and table.resident < budget and holes:
        layer.write(seq, k[0], v[0], int(positions[0]))  # decoding, room in its own pages: nothing else to do
        return
    start = 0
    if len(positions) > 1 and keep is None and not policy.prunes and store.in_place and not store.kivi:
        start = write_chunk(layer, seq, k, v, positions)  # a prompt chunk: its K/V in one store call
    for i in range(start, len(positions)):
        position = positions[i]
        if keep is not None:
            evict_heads(layer, seq)
        if policy.prunes:
            prune(layer, seq)
        if table.resident >= budget or not (holes or store.pages.can_allocate()):
            if not policy.evicts and table.resident < budget:
                raise CacheFullError(f"the pool's {layer.pool_pages} pages of layer {index} are all in use "
                                     f"(sequence {seq.seq_id} needs one more)")
            evict(layer, seq)
        layer.write(seq, k[i], v[i], int(position))


def write_chunk(layer: LayerManager, seq: SequenceCache, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> int:
    """`append`'s loop for the first tokens of a chunk that need only a slot (under the budget, an empty slot or a
    page to allocate: no eviction; the caller checked there are no per-head masks or pruning and that the pages are
    float32 in RAM, `store.in_place`): each token's slot chosen, its table, policy statistics and event updated as
    `LayerManager.write` does, in order, then the K/V, positions and occupancy of all of them in one store call
    (`PageStore.write_rows`). Returns how many tokens it wrote (`append` writes the rest one by one). Each slot is
    in a page of the sequence's own (`free_slot` copies a shared one first), so no copy reads a slot held here."""
    store, table = layer.store, layer.table(seq)
    holes, budget, can_allocate = table.holes, layer.budget(seq), store.pages.can_allocate
    ints, flats = positions.tolist(), []
    for i, position in enumerate(ints):
        if table.resident >= budget or not (holes or can_allocate()):
            break
        flat = own_hole(layer, table)
        if flat is None:
            flat = layer.free_slot(seq, table)  # a page allocated, or copied or forgotten first
        layer.wrote(seq, table, flat, k[i], v[i], position)
        flats.append(flat)
    if flats:
        n = len(flats)
        store.write_rows(np.array(flats, np.int64), np.arange(n, dtype=np.int64), k, v,
                         np.asarray(positions, dtype=np.int64), max(ints[:n]))
    return len(flats)


def evict(layer: LayerManager, seq: SequenceCache) -> None:
    """The policy's victims: as many as it evicts at once (periodic compression: N, one choice at a time),
    down to the budget minus that (or to the last token the policy may evict)."""
    policy, table = seq.policy, layer.table(seq)
    target = table.resident - policy.evicted_at_once()
    while True:
        view = layer.view(seq)
        victims, scores = policy.choose_victims(view)
        if policy.merges:
            merge(layer, seq, victims, scores, *policy.merge_targets(view, victims))
        else:
            remove(layer, seq, victims, scores, policy.reason)
        if table.resident <= target or not (view.occupied() & ~policy.protected(view)).any():
            return


def prune(layer: LayerManager, seq: SequenceCache) -> None:
    """A pruning policy's victims before the next token, however full the cache is."""
    victims, scores = seq.policy.choose_pruned(layer.view(seq))
    if len(victims):
        remove(layer, seq, victims, scores, seq.policy.reason)


def evict_heads(layer: LayerManager, seq: SequenceCache) -> None:
    """A per-head policy's drops before the next token."""
    drop_entries(layer, seq, *seq.policy.choose_head_victims(layer.view(seq)))


def compress(layers: list[LayerManager], seq: SequenceCache) -> None:
    """A compressing policy's one-shot drops (kvzip), every layer at once."""
    drops = seq.policy.compress([layer.view(seq) for layer in layers])
    for layer, (heads, victims, scores) in zip(layers, drops, strict=True):
        drop_entries(layer, seq, heads, victims, scores)


def drop_entries(layer: LayerManager, seq: SequenceCache, heads: np.ndarray, victims: np.ndarray,
                 scores: np.ndarray) -> None:
    """Mask each (KV head, slot) entry named; free the slots no KV head keeps any more."""
    if not len(victims):
        return
    gone = layer.drop_entries(seq, heads, victims, scores)
    if len(gone):
        remove(layer, seq, gone, np.full(len(gone), np.nan), "dropped by every KV head")


def remove(layer: LayerManager, seq: SequenceCache, victims: np.ndarray, scores: np.ndarray, reason: str,
           details: list[int] | None = None) -> None:
    """Take the tokens in these flat slots out of the sequence (copying a shared page first), free the pages
    left empty, then tell its policy. `details`: each eviction event's detail (merges: the survivor's position)."""
    seq.policy.after_removal(layer, seq, layer.evict(seq, victims, scores, reason, details))


def merge(layer: LayerManager, seq: SequenceCache, victims: np.ndarray, scores: np.ndarray, targets: np.ndarray,
          weights: np.ndarray) -> None:
    """Evict the victims, folding each one's value into its target survivor (v <- (1 - w) v + w v_victim;
    -1: none); the eviction events name the survivor's position. Targets are found again by position
    after the removal, which may have copied their page."""
    values = layer.values_at(victims)  # (n_kv, victims, d)
    into = np.where(targets >= 0, layer.positions_at(targets), -1).tolist()
    remove(layer, seq, victims, scores, seq.policy.reason, details=into)
    layer.rewrites.fold_values(seq, into, values, weights, near=targets.tolist())


def prune_key_channels(layers: list[LayerManager], seq: SequenceCache) -> None:
    """ThinK: each layer's key channels chosen and the pruned ones zeroed in the keys the sequence holds (a
    shared page is copied first and keeps its prefix hash; a page changed in place leaves the prefix cache; the
    sequence registers no more pages: they no longer hold the prefix's plain keys)."""
    seq.hashable = False
    for layer in layers:
        layer.rewrites.prune_key_channels(seq)

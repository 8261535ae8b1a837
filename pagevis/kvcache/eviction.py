"""Writing a sequence's tokens into one layer (`append`), and eviction: what the cache does with a policy's
choices there.

The policy chooses (policies/): whole tokens when the layer is at its budget (`evict`, N at once for periodic
compression), tokens under a threshold before every write (`prune`), (KV head, token) entries for a per-head
policy (`evict_heads`, and kvzip's one-shot `compress`); a merging policy also names the survivor each victim's
value folds into (`merge`). Here the choice is carried out: every page about to change is asked for through
`LayerManager.writable` (a shared page is copied and keeps its prefix hash; a page changed in place leaves the
prefix cache), a page left empty is released, every change is an event; then the policy hears of the removal
(a re-rotating policy moves the survivors' keys: wrappers.py). ThinK's key-channel pruning
(`prune_key_channels`) rewrites keys in place the same way.

Each function takes the layer's manager (layer_managers.py) and the sequence, and changes the sequence's pages
through the manager's named operations: `write` a token, `take_out` one, `writable` for a page about to change.
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache.errors import CacheFullError
from pagevis.kvcache.events import EventKind
from pagevis.kvcache.layer_managers import LayerManager
from pagevis.kvcache.sequence import SequenceCache

E = EventKind


def append(layer: LayerManager, seq: SequenceCache, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
    """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions into the sequence's own
    pages, evicting (its policy) at its budget and copying any shared page before changing it."""
    store, index, policy = layer.store, layer.layer, seq.policy
    if store.kivi:
        layer.seal_residual(seq, len(positions))
    if len(positions):
        layer.before_write(seq, int(positions[0]))
    holes, keep = seq.holes[index], seq.head_keep[index]
    budget = layer.budget(seq)
    if seq.channels is not None:
        k = seq.channels.prune(index, k)
    for i, position in enumerate(positions):
        if keep is not None:
            evict_heads(layer, seq)
        if policy.prunes:
            prune(layer, seq)
        if seq.resident[index] >= budget or not (holes or store.pages.can_allocate()):
            if not policy.evicts and seq.resident[index] < budget:
                raise CacheFullError(f"the pool's {layer.pool_pages} pages of layer {index} are all in use "
                                     f"(sequence {seq.seq_id} needs one more)")
            evict(layer, seq)
        layer.write(seq, k[i], v[i], int(position))


def evict(layer: LayerManager, seq: SequenceCache) -> None:
    """The policy's victims: as many as it evicts at once (periodic compression: N, one choice at a time),
    down to the budget minus that (or to the last token the policy may evict)."""
    policy = seq.policy
    target = seq.resident[layer.layer] - policy.evicted_at_once()
    while True:
        view = layer.view(seq)
        victims, scores = policy.choose_victims(view)
        if policy.merges:
            merge(layer, seq, victims, scores, *policy.merge_targets(view, victims))
        else:
            remove(layer, seq, victims, scores, policy.reason)
        if seq.resident[layer.layer] <= target or not (view.occupied() & ~policy.protected(view)).any():
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
    keep, ps, positions = seq.head_keep[layer.layer], layer.page_size, layer.store.positions
    assert keep is not None  # only a per-head policy drops entries, and its sequence keeps masks
    for head, flat, score in zip(heads.tolist(), victims.tolist(), scores.tolist(), strict=True):
        if not keep[head, flat]:
            raise RuntimeError(f"policy {seq.policy.name!r} dropped an entry KV head {head} no longer keeps")
        keep[head, flat] = False
        layer.event(E.MASK, seq, *divmod(flat, ps), int(positions[flat]), seq.policy.name, seq.policy.reason,
                    float(score), detail=head)
    gone = np.unique(victims[~keep[:, victims].any(axis=0)])
    if len(gone):
        remove(layer, seq, gone, np.full(len(gone), np.nan), "dropped by every KV head")


def remove(layer: LayerManager, seq: SequenceCache, victims: np.ndarray, scores: np.ndarray, reason: str,
           details: list[int] | None = None) -> None:
    """Take the tokens in these flat slots out of the sequence (copying a shared page first); free
    the pages left empty. `details`: each eviction event's detail (merges: the survivor's position)."""
    ps = layer.page_size
    seq.hashable = False
    copies: dict[int, int] = {}  # shared page -> this sequence's copy (a policy may take several slots)
    removed: list[int] = []
    for flat, score, detail in zip(victims.tolist(), scores.tolist(), details or [-1] * len(victims), strict=True):
        page, slot = divmod(flat, ps)
        if page not in copies:
            copies[page] = layer.writable(seq, page)
        removed.append(layer.take_out(seq, copies[page] * ps + slot, reason, float(score), detail))
    seq.policy.after_removal(layer, seq, removed)


def merge(layer: LayerManager, seq: SequenceCache, victims: np.ndarray, scores: np.ndarray, targets: np.ndarray,
          weights: np.ndarray) -> None:
    """Evict the victims, folding each one's value into its target survivor (v <- (1 - w) v + w v_victim;
    -1: none); the eviction events name the survivor's position. Targets are found again by position
    after the removal, which may have copied their page."""
    store, ps = layer.store, layer.page_size
    values = store.v[:, victims // ps, victims % ps].astype(np.float64)  # (n_kv, victims, d)
    into = np.where(targets >= 0, store.positions[targets], -1)
    remove(layer, seq, victims, scores, seq.policy.reason, details=into.tolist())
    slot_of = _slot_of(layer, seq)
    for i, position in enumerate(into.tolist()):
        if position < 0:
            continue
        page, slot = divmod(slot_of[position], ps)
        if (own := layer.writable(seq, page)) != page:
            page, slot_of = own, _slot_of(layer, seq)
        merged = (1 - weights[i]) * store.v[:, page, slot].astype(np.float64) + weights[i] * values[:, i]
        store.v[:, page, slot] = merged.astype(store.v.dtype)


def _slot_of(layer: LayerManager, seq: SequenceCache) -> dict[int, int]:
    """Position -> flat slot of the sequence's tokens in the layer."""
    flat = layer.flat(seq)
    return dict(zip(layer.store.positions[flat].tolist(), flat.tolist(), strict=True))


def prune_key_channels(layers: list[LayerManager], seq: SequenceCache) -> None:
    """ThinK: each layer's key channels chosen from its query window and the keys the sequence holds, and
    the pruned ones zeroed in those keys (a shared page is copied first and keeps its prefix hash; a page
    changed in place leaves the prefix cache; the sequence registers no more pages: they no longer hold the
    prefix's plain keys)."""
    seq.hashable = False
    channels = seq.channels
    assert channels is not None  # called only for a sequence with key_channels
    for layer in layers:
        store, ps = layer.store, layer.page_size
        for page in list(seq.block_tables[layer.layer]):
            layer.writable(seq, page)
        flat = layer.flat(seq)
        flat = flat[store.positions[flat] >= 0]
        pages, slots = flat // ps, flat % ps
        kept = channels.choose(layer.layer, store.k[:, pages, slots])
        store.k[:, pages, slots] *= kept[:, None, :].astype(store.k.dtype)

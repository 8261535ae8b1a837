"""What the cache shows of one sequence after a step, given in one call (KVCacheManager.snapshot): per layer
the slot maps, the slots its policy protects, its scores, which slots still hold float32 (KIVI's residual),
the RAM frame of each block-table page, the tokens each layer may hold and what kind of layer it is.

The engine's step record is made of it (engine/session.py), so that nothing above the cache reaches into a
PageStore (tests/test_layering.py) or builds a policy to learn a layer's budget. A caller that shows the pool differently (a session in a
shared engine shows only its own pages: serve/session_pages.py) passes `held`, which sees each layer's RAM
frames through a read-only LayerFrames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from pagevis.kvcache.layer_spec import layer_specs

from pagevis.kvcache.slots import flat_slots


@dataclass(frozen=True)
class LayerFrames:
    """What one layer's RAM frames hold, read-only. page_in: per RAM frame, the page id it holds (-1: none);
    positions: per flat page-id slot (page id * page_size + slot), the token position it holds (-1: empty)."""

    page_in: np.ndarray
    positions: np.ndarray
    tiered: bool
    page_size: int


@dataclass(frozen=True)
class CacheSnapshot:
    """One sequence's cache after a step, every layer (arrays with a leading layer axis, `shown` frames each).

    slot_maps:      (n_layers, shown, page_size) int32, the token position per slot, -1 empty
    protected:      (n_layers, shown, page_size) bool, the slots the policy will not evict
    scores:         (n_layers, shown, page_size) float32, the policy's keep-score per slot (NaN empty)
    full_precision: with int4 / int2 storage, (n_layers, shown, page_size) bool: the slots still in float32
                    (KIVI's residual window); None for other storage
    capacities:     per layer, the tokens the sequence's policy lets it hold (less than the pool under
                    pyramidkv or duo)
    labels:         per layer, what it is: 'global' or 'local W=512'
    block_frames:   with a disk tier or a page selection, per layer the RAM frame of each block-table page
                    (-1: on disk only); None without either
    """

    slot_maps: np.ndarray
    protected: np.ndarray
    scores: np.ndarray
    full_precision: np.ndarray | None
    capacities: tuple[int, ...]
    labels: tuple[str, ...]
    block_frames: tuple[tuple[int, ...], ...] | None


# (layer, its frames) -> per slot of the `shown` frames, the flat page-id slot it holds (-1: none); or None for
# the layer's own RAM frames as they are
HeldSlots = Callable[[int, LayerFrames], "np.ndarray | None"]


def layer_frames(store) -> LayerFrames:
    """A PageStore's frames, read-only (views of its arrays: they change with the next step)."""
    return LayerFrames(_read_only(store.page_in), _read_only(store.positions), bool(store.tiered), store.page_size)


def take(cache, seq_id: int, shown: int, held: HeldSlots | None = None) -> CacheSnapshot:
    """The snapshot of sequence `seq_id` of KVCacheManager `cache`, `shown` frames per layer."""
    seq = cache.sequences[seq_id]
    policy, ps = seq.policy, cache.page_size
    shape = (shown, ps)
    slot_maps, protected, scores, full = [], [], [], []
    for layer, store in enumerate(cache.stores):
        view = cache.view(seq_id, layer)
        slots = held(layer, layer_frames(store)) if held is not None else None
        if slots is None:
            slots = _own_slots(store)
            slot_maps.append(store.frame_slot_map())
        else:
            slot_maps.append(np.where(slots < 0, -1, store.positions[slots]).reshape(shape))
        empty = slots < 0
        protected.append(np.where(empty, False, policy.protected(view)[slots]).reshape(shape))
        score = np.where(view.occupied(), policy.score(view), np.nan)
        scores.append(np.where(empty, np.nan, score[slots]).reshape(shape))
        if store.kivi:  # slots whose tokens are still in the residual window (float32)
            full.append(np.where(empty, False, store.res_of[np.maximum(slots, 0)] >= 0).reshape(shape))
    maps = np.stack(slot_maps).astype(np.int32)
    frames = None
    if cache.config.tiered or cache.select_pages is not None:
        frames = tuple(tuple(store.frame_of[np.asarray(table, dtype=np.int64)].tolist())
                       for store, table in zip(cache.stores, cache.block_tables(seq_id), strict=True))
    return CacheSnapshot(
        slot_maps=maps, protected=np.stack(protected), scores=np.stack(scores).astype(np.float32),
        full_precision=np.stack(full) & (maps >= 0) if full else None,
        capacities=tuple(int(policy.layer_capacity(layer)) for layer in range(len(cache.stores))),
        labels=_labels(cache.config.sliding_windows, cache.config.n_layers), block_frames=frames)


@lru_cache(maxsize=64)
def _labels(windows: tuple[int | None, ...] | None, n_layers: int) -> tuple[str, ...]:
    """Each layer's spec label (made once per layout: every step asks)."""
    return tuple(spec.label for spec in layer_specs(windows, n_layers))


def _own_slots(store) -> np.ndarray:
    """Per RAM slot, the flat page-id slot (page id * page size + slot) of the page its frame holds, -1 if none."""
    ps = store.page_size
    held = flat_slots(store.page_in, ps)
    return np.where(np.repeat(store.page_in >= 0, ps), held, -1)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view

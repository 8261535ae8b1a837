"""What changes tokens that stay in one layer, in place: a merge's survivors' values, re-rotated keys, ThinK's pruned
key channels, KIVI's sealed key groups. Each layer's manager holds one (`LayerManager.rewrites`, layer_managers.py)
and every page these change comes from its one copy-on-write door, `LayerManager.writable`: a shared page is copied
first and keeps its K/V and its prefix hash; a page changed in place no longer stands for its prefix hash (KIVI's
sealing excepted: every sequence with that prefix quantizes the same tokens alike)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagevis.kvcache.events import EventLog
from pagevis.kvcache.policies.lazy_kernels import kernels
from pagevis.kvcache.quantized_pages import QuantizedPages
from pagevis.kvcache.rope_shift import rotate
from pagevis.kvcache.sequence import LayerTable, SequenceCache
from pagevis.kvcache.slots import page_and_slot
from pagevis.kvcache.store import PageStore


class Manager(Protocol):
    """What a Rewrites asks of the layer manager that holds it (layer_managers.LayerManager)."""

    store: PageStore
    log: EventLog
    layer: int
    page_size: int

    def writable(self, seq: SequenceCache, page: int, keeps_prefix: bool = False) -> int: ...

    def flat(self, seq: SequenceCache) -> np.ndarray: ...

    def table(self, seq: SequenceCache) -> LayerTable: ...


class Rewrites:
    """The in-place changes to one layer's surviving tokens (its manager's part)."""

    def __init__(self, layer: Manager):
        self.layer = layer

    def _slot_of(self, seq: SequenceCache, position: int, near: int) -> int:
        """The flat slot of the sequence's token at `position` here: `near` (where it was before the
        removal, -1: unknown) if it is still there, else found among the sequence's slots (its page was copied).
        A sequence holds each position once: the slot found is the only one."""
        store, table = self.layer.store, self.layer.table(seq)
        if near >= 0 and store.positions[near] == position and near // self.layer.page_size in table.pages:
            return near
        flat = self.layer.flat(seq)
        found = np.flatnonzero(store.positions[flat] == position)
        if not len(found):
            raise KeyError(f"sequence {seq.seq_id} holds no token at position {position} in layer "
                           f"{self.layer.layer}")
        return int(flat[found[-1]])

    def fold_values(self, seq: SequenceCache, into: list[int], values: np.ndarray, weights: np.ndarray,
                    near: list[int] | None = None) -> None:
        """Merging: the survivor at position into[i] (-1: none) takes v <- (1 - w_i) v + w_i values[:, i]
        (values (n_kv, len(into), head_dim), float64), its page copied first if shared. near[i]: the survivor's
        flat slot before the victims' removal (the removal may have copied its page; -1 or None: look it up)."""
        store, ps = self.layer.store, self.layer.page_size
        for i, position in enumerate(into):
            if position < 0:
                continue
            page, slot = divmod(self._slot_of(seq, position, near[i] if near is not None else -1), ps)
            page = self.layer.writable(seq, page)
            if store.v.dtype == np.float32:  # one numba call (the same float64 arithmetic, rounded as NumPy does)
                kernels().fold_value(store.v, page, slot, values[:, i], float(weights[i]))
                continue
            merged = (1 - weights[i]) * store.v[:, page, slot].astype(np.float64) + weights[i] * values[:, i]
            store.v[:, page, slot] = merged.astype(store.v.dtype)

    def rotate_keys(self, seq: SequenceCache, moved: np.ndarray, delta: np.ndarray, inv_freq: np.ndarray) -> None:
        """Re-rotation: the keys in flat slots `moved` rotated by `delta` positions (RoPE, rope_shift.py), their
        pages copied first if shared; with ThinK, the pruned channels stay zero."""
        store = self.layer.store
        moved = self._writable(seq, moved)
        pages, slots = page_and_slot(moved, self.layer.page_size)
        rotated = rotate(store.k[:, pages, slots], delta, inv_freq).astype(store.k.dtype)
        if seq.channels is not None:  # ThinK: a RoPE pair with one channel pruned keeps that channel zero
            rotated = seq.channels.prune(self.layer.layer, rotated.transpose(1, 0, 2)).transpose(1, 0, 2)
        store.k[:, pages, slots] = rotated

    def prune_key_channels(self, seq: SequenceCache) -> None:
        """ThinK: the layer's key channels chosen from its query window and the keys the sequence holds, and the
        pruned ones zeroed in those keys (every page through `writable`: a shared one is copied)."""
        store, channels = self.layer.store, seq.channels
        assert channels is not None  # called only for a sequence with key_channels
        for page in list(self.layer.table(seq).pages):
            self.layer.writable(seq, page)
        flat = self.layer.flat(seq)
        flat = flat[store.positions[flat] >= 0]
        pages, slots = page_and_slot(flat, self.layer.page_size)
        kept = channels.choose(self.layer.layer, store.k[:, pages, slots])
        store.k[:, pages, slots] *= kept[:, None, :].astype(store.k.dtype)

    def seal_residual(self, seq: SequenceCache, n_new: int) -> None:
        """int4 / int2 (KIVI), before n_new tokens are written: while the sequence's full-precision tokens would
        then exceed residual + group - 1, quantize the oldest `group` (32) of them (written in earlier calls) as
        one key group. A prefill chunk is attended in full precision; in decoding the newest `residual` tokens
        stay float32 and the oldest 32 beyond them are quantized once they have all arrived. A shared page is
        copied first: the change is this sequence's alone."""
        store = self.layer.store
        assert isinstance(store, QuantizedPages)  # only int4 / int2 stores have a residual window
        group, limit = store.layout.group, store.layout.residual + store.layout.group - 1
        window = store.residual_slots(self.layer.flat(seq))
        while len(window) >= group and len(window) + n_new > limit:
            oldest = window[np.argsort(store.positions[window], kind="stable")[:group]]
            store.seal(self._writable(seq, oldest, keeps_prefix=True), self.layer.log.step)
            window = store.residual_slots(self.layer.flat(seq))

    def _writable(self, seq: SequenceCache, flats: np.ndarray, keeps_prefix: bool = False) -> np.ndarray:
        """The flat slots `flats` once each of their pages is writable (`LayerManager.writable`): the slots of a
        shared page move to the same slots of its copy."""
        ps = self.layer.page_size
        for page in np.unique(flats // ps).tolist():
            if (copy := self.layer.writable(seq, page, keeps_prefix=keeps_prefix)) != page:
                pages, slots = page_and_slot(flats, ps)
                flats = np.where(pages == page, copy * ps + slots, flats)
        return flats

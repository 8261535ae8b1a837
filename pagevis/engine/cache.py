"""The paged KV cache: per-layer page stores, one sequence's block tables, the eviction policy and its
per-layer state, events, and paged attention."""

from __future__ import annotations

import numpy as np

from .attention import AttentionResult, attend
from .config import CacheConfig
from .events import CacheEvent, EventKind
from .policies import EvictionPolicy, make_policy
from .policy_state import LayerView, PolicyState
from .reader import read_attention
from .sequence import Sequence
from .store import PageStore, TierCounts
from .swap import SwapSpace

# With a disk tier, prefill chunks are cut so that their scores over a batch of frames, and their weights
# over every slot when the policy learns from attention, stay under this many float32 values (32 MB).
MAX_CHUNK_WEIGHTS = 8 << 20
# With a disk tier the free slots no longer bound a prefill chunk; this does, so that a long prompt's
# transient arrays (and the process's memory after them) do not grow with the context.
MAX_TIERED_CHUNK = 1024


class PagedKVCache:
    """K/V for every layer in fixed-size pages. Tokens keep their absolute positions; when a layer is
    full, its policy chooses which tokens leave. Every change is recorded as a CacheEvent.

    Per step the caller sets `step`, then per layer: `append` the new tokens' K/V, then `attend`.
    `attend` hands the attention weights to the policy's state of that layer when the policy scores
    by attention.
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.policy: EvictionPolicy = make_policy(config)
        self.swap = SwapSpace(config.n_layers, config.page_bytes(), config.swap_dir) if config.tiered else None
        self.stores = [PageStore(config, layer, self.swap.files[layer] if self.swap else None)
                       for layer in range(config.n_layers)]
        for store in self.stores:
            store.on_move = self._move_event(store.layer)
        self.select_pages = config.select_pages if config.select == "quest" else None
        self.read_slots: list[np.ndarray | None] = [None] * config.n_layers  # what each layer read last
        self.sequence = Sequence(config.n_layers)
        self.states: list[PolicyState] = [self.policy.make_state(s.n_slots) for s in self.stores]
        self.views = [LayerView(layer, config.page_size, store.positions, self.sequence.block_tables[layer],
                                self.states[layer]) for layer, store in enumerate(self.stores)]
        self.step = 0
        self.events: list[CacheEvent] = []

    def close(self) -> None:
        """Remove the swap files now (they are removed at exit or garbage collection otherwise)."""
        if self.swap is not None:
            self.swap.close()

    def reset(self) -> None:
        for store, state in zip(self.stores, self.states, strict=True):
            store.reset()
            state.reset()
        self.read_slots = [None] * self.config.n_layers
        self.sequence.reset()
        self.policy.reset()
        self.step = 0
        self.events = []

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def take_counts(self) -> list[TierCounts]:
        """Per layer, what moved between the tiers since the last call."""
        return [store.take_counts() for store in self.stores]

    # --- questions -------------------------------------------------------------------------------
    def view(self, layer: int) -> LayerView:
        return self.views[layer]

    def block_table(self, layer: int) -> list[int]:
        return self.sequence.block_tables[layer]

    def free_slots(self) -> int:
        """Tokens every layer can take before its policy must evict (a policy may give a layer less than
        its pool: pyramidkv)."""
        return min(min(store.free_slots(), self.policy.layer_capacity(layer) - store.resident)
                   for layer, store in enumerate(self.stores))

    def can_append(self, n: int) -> bool:
        """Whether n more tokens fit, by eviction if the policy evicts. Check before a step so that a
        full cache fails before any layer has changed."""
        return self.policy.evicts or self.free_slots() >= n

    def max_chunk(self) -> int | None:
        """The most tokens one prefill step may feed (None: no limit beyond the free slots). With a
        disk tier, a chunk's scores over one batch of frames (and for a policy that learns from
        attention, its weights over every slot) stay under MAX_CHUNK_WEIGHTS floats. With
        quest, a chunk stops where the sequence outgrows select_pages pages: from there on every
        query is fed alone and reads its own selection."""
        limits = []
        cfg = self.config
        if cfg.tiered:  # scores of a chunk's queries over the keys of one batch of frames
            frames = max(cfg.home_frames, cfg.max_pages - cfg.home_frames)
            limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * frames * cfg.page_size))
            limits.append(MAX_TIERED_CHUNK)
            if self.policy.uses_attention:
                limits.append(MAX_CHUNK_WEIGHTS // (cfg.n_heads * cfg.capacity))
        if self.select_pages is not None:
            limits.append(self.select_pages * cfg.page_size - max(store.resident for store in self.stores))
        return max(1, min(limits)) if limits else None

    def weight_positions(self, layer: int, result: AttentionResult) -> np.ndarray:
        """Token position of each weight column of an `attend` result."""
        if result.slots is None:
            return self.slot_positions(layer)
        return self.stores[layer].positions[result.slots]

    def slot_positions(self, layer: int) -> np.ndarray:
        """Token position of each flat slot in the allocated prefix (what `attend`'s weights index)."""
        store = self.stores[layer]
        return store.positions[: store.high_water * store.page_size]

    def resident_positions(self, layer: int) -> np.ndarray:
        positions = self.stores[layer].positions
        return np.sort(positions[positions >= 0])

    # --- changes ---------------------------------------------------------------------------------
    def ensure_room(self, n: int) -> None:
        """Raise before anything changes if n tokens cannot go in: CacheFullError from policy 'none',
        SwapSpaceError when the disk tier has no space for the pages they may need."""
        if not self.can_append(n):
            self.policy.choose_victims(self.views[0])  # raises the policy's CacheFullError
        for store in self.stores:
            store.reserve(n)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Write n tokens' K/V (each (n, n_kv_heads, head_dim)) at their positions, evicting as needed."""
        store, state = self.stores[layer], self.states[layer]
        budget = self.policy.layer_capacity(layer)
        for i, position in enumerate(positions):
            if store.free_slots() == 0 or store.resident >= budget:
                self._evict(layer)
            if not store.holes:
                page = store.allocate(self.step)
                self.sequence.block_tables[layer].append(page)
                self._event(EventKind.ALLOCATE, layer, page, frame=int(store.frame_of[page]) if store.tiered else -1)
            flat = store.take_hole(self.step)
            store.write(flat, k[i], v[i], int(position))
            state.clear(flat)
            self._event(EventKind.WRITE, layer, *divmod(flat, store.page_size), int(position))

    def _evict(self, layer: int) -> None:
        store, table = self.stores[layer], self.sequence.block_tables[layer]
        victims, scores = self.policy.choose_victims(self.views[layer])
        for flat, score in zip(victims.tolist(), scores.tolist()):
            position = store.remove(flat)
            page, slot = divmod(flat, store.page_size)
            self._event(EventKind.EVICT, layer, page, slot, position, self.policy.name, self.policy.reason,
                        float(score))
            if store.fill[page] == 0:
                store.release(page)
                table.remove(page)
                self._event(EventKind.RELEASE, layer, page)

    def _event(self, kind: EventKind, layer: int, page: int, slot: int = -1, position: int = -1,
               policy: str = "", reason: str = "", score: float = float("nan"), frame: int = -1) -> None:
        self.events.append(CacheEvent(kind, self.step, layer, page, slot, position, policy, reason, score, frame))

    def _move_event(self, layer: int):
        def moved(kind: EventKind, page: int, frame: int, detail: str) -> None:
            self._event(kind, layer, page, reason=detail, frame=frame)
        return moved

    # --- attention -------------------------------------------------------------------------------
    def attend(self, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention of n queries (n, n_heads, head_dim) at `positions` over the layer's resident tokens.

        Weights come back over the flat slots of the allocated prefix of the pool,
        (n, n_heads, high_water * page_size), zero on empty slots; `slot_positions(layer)` maps them.
        """
        store = self.stores[layer]
        if store.tiered or (self.select_pages is not None and len(q) == 1):
            return self._read(layer, q, positions)
        self.read_slots[layer] = None
        n_slots = store.high_water * store.page_size
        n_kv, _, _, head_dim = store.k.shape
        keys = store.k[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
        values = store.v[:, : store.high_water].reshape(n_kv, n_slots, head_dim)
        # With no empty slot below the high-water mark the occupancy mask is all zeros: skip it.
        bias = None if store.resident == n_slots else store.bias[:n_slots]
        result = attend(q, keys, values, bias, store.positions[:n_slots], positions)
        if self.policy.uses_attention:
            self.states[layer].observe(result.weights, slice(0, n_slots))
        return result

    def _read(self, layer: int, q: np.ndarray, positions: np.ndarray) -> AttentionResult:
        """Attention through the reader: pages on disk, or a page selection (a chunk of several
        queries reads every page: max_chunk keeps such chunks within select_pages pages)."""
        select = self.select_pages if len(q) == 1 else None
        result = read_attention(self.stores[layer], self.sequence.block_tables[layer], q, positions, self.step,
                                select, all_weights=self.policy.uses_attention and len(q) > 1)
        self.read_slots[layer] = result.slots
        if self.policy.uses_attention:
            self.states[layer].observe(result.weights, result.slots)
        return result

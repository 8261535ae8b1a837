"""The statistics an eviction policy keeps about one layer's tokens, and the view a policy reads.

The store owns K/V and which token sits where; the sequence owns its block tables; what a policy learns
from attention lives here. A policy that needs a statistic subclasses PolicyState in its own file,
allocates its arrays with `add_array` (they are zeroed on reset and when a new token takes a slot) and
overrides `observe`; the policy names the subclass as its `state_class`. Nothing else changes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PolicyState:
    """Per flat slot (page * page_size + slot) statistics of one layer. The base keeps none."""

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.arrays: dict[str, np.ndarray] = {}

    def add_array(self, name: str, dtype=np.float64, width: tuple[int, ...] = ()) -> np.ndarray:
        """A per-slot array, (n_slots, *width): row `flat` belongs to the token in that slot."""
        array = np.zeros((self.n_slots, *width), dtype=dtype)
        self.arrays[name] = array
        return array

    def reset(self) -> None:
        for array in self.arrays.values():
            array.fill(0)

    def clear(self, flat: int) -> None:
        """A new token took this slot: it starts with no history."""
        for array in self.arrays.values():
            array[flat] = 0

    def took(self, flat: int, k: np.ndarray, v: np.ndarray, position: int) -> None:
        """A new token took slot flat: `clear` then `write` (what every write does; the base keeps nothing)."""
        self.clear(flat)
        self.write(flat, k, v, position)

    def observe(self, weights: np.ndarray, slots: slice | np.ndarray) -> None:
        """One attention call's weights, (n_queries, n_heads, m), over the flat slots `slots` (the
        tokens actually read; m of them). Slots not read got no attention this step. Called only for
        policies with `uses_attention`."""

    def write(self, flat: int, k: np.ndarray, v: np.ndarray, position: int) -> None:
        """The key and value of the token at `position`, each (n_kv_heads, head_dim) as the model made them
        (after RoPE), were written into slot `flat` (just after `clear(flat)`). Called for every policy."""

    def reconstruct(self, weights: np.ndarray, slots: np.ndarray) -> None:
        """A reconstruction pass's weights (n_queries, n_heads, len(slots)) over these flat slots: queries that
        read the cache without writing (`KVCacheManager.attend_beside`; kvzip keeps their maxima)."""

    def query(self, q: np.ndarray, positions: np.ndarray) -> None:
        """One attention call's queries (n, n_heads, head_dim), after RoPE, at `positions`; before the
        call's `observe`. Called only for policies with `uses_queries`."""


class LayerView(NamedTuple):
    """What a policy reads about one layer of one sequence (live arrays, not copies)."""

    layer: int
    page_size: int
    positions: np.ndarray  # flat slot -> token position, -1 where empty
    block_table: list[int]  # the sequence's page ids in logical order
    stats: PolicyState
    # per-head policies only: (n_kv_heads, n_slots) bool, True where that KV head still keeps the token
    head_keep: np.ndarray | None = None

    def occupied(self) -> np.ndarray:
        return self.positions >= 0

    def kept(self) -> np.ndarray:
        """(n_kv_heads, n_slots) bool: the tokens each KV head keeps (every resident token for every head,
        unless the policy evicts per head). For a token-level policy a (1, n_slots) row stands for all heads."""
        if self.head_keep is None:
            return self.occupied()[None, :]
        return self.head_keep & self.occupied()

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

    def add_array(self, name: str, dtype=np.float64) -> np.ndarray:
        array = np.zeros(self.n_slots, dtype=dtype)
        self.arrays[name] = array
        return array

    def reset(self) -> None:
        for array in self.arrays.values():
            array.fill(0)

    def clear(self, flat: int) -> None:
        """A new token took this slot: it starts with no history."""
        for array in self.arrays.values():
            array[flat] = 0

    def observe(self, weights: np.ndarray, slots: slice | np.ndarray) -> None:
        """One attention call's weights, (n_queries, n_heads, m), over the flat slots `slots` (the
        tokens actually read; m of them). Slots not read got no attention this step."""


class LayerView(NamedTuple):
    """What a policy reads about one layer of one sequence (live arrays, not copies)."""

    layer: int
    page_size: int
    positions: np.ndarray  # flat slot -> token position, -1 where empty
    block_table: list[int]  # the sequence's page ids in logical order
    stats: PolicyState

    def occupied(self) -> np.ndarray:
        return self.positions >= 0

"""One (medium, KV cache group) of an engine's state (state.py), and the indexes the explainer (explain.py) asks:
resident blocks and remembered removed ones by (parent hash, packed tokens). Both indexes are built on the first
question and kept up to date from then on (None until then), so a plain attach pays nothing for them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

_NONE = object()


class _Many(dict):
    """Several values under one key (a dict for O(1) removal, in insertion order)."""


class MultiIndex:
    """key -> values; one value is held alone, several in a `_Many`. Every operation is O(1), however many values
    a key gathers (a stream repeating one first block under one parent must not make it quadratic)."""

    __slots__ = ("map",)

    def __init__(self) -> None:
        self.map: dict = {}

    def add(self, key: Any, value: Any) -> None:
        held = self.map.get(key, _NONE)
        if held is _NONE:
            self.map[key] = value
        elif type(held) is _Many:
            held[value] = None
        elif held != value:
            self.map[key] = _Many({held: None, value: None})

    def discard(self, key: Any, value: Any) -> None:
        held = self.map.get(key, _NONE)
        if type(held) is _Many:
            held.pop(value, None)
            if len(held) == 1:
                self.map[key] = next(iter(held))
        elif held is not _NONE and held == value:
            del self.map[key]

    def get(self, key: Any) -> tuple:
        held = self.map.get(key, _NONE)
        return () if held is _NONE else tuple(held) if type(held) is _Many else (held,)


class Tier:
    __slots__ = ("index", "medium", "group", "slot_of", "heads", "removed_at", "removed_key", "children")

    def __init__(self, index: int, medium: str, group: int | None):
        self.index, self.medium, self.group = index, medium, group
        self.slot_of: dict[Any, int] = {}  # hash -> slot
        self.heads: dict[Any, int] = {}  # parent hash (None for roots) -> first child slot
        # hash -> ts of its removal, oldest first. An OrderedDict: dropping a plain dict's first key again and again
        # scans the deleted entries before it (quadratic), popitem(last=False) does not.
        # The value is (removal ts, parent hash, packed tokens, store ts, extras): what explain.py says of a block
        # that was stored and removed; `removed_key` finds their hashes by (parent hash, packed tokens), several
        # when extra keys (a cache salt, a LoRA) made the same tokens under the same parent other blocks.
        self.removed_at: OrderedDict[Any, tuple] = OrderedDict()
        self.removed_key: MultiIndex | None = None
        self.children: MultiIndex | None = None  # (parent hash, packed tokens) -> resident slots

    def remember_removed(self, block_hash: Any, record: tuple) -> None:
        if self.removed_key is not None:
            self.removed_key.add((record[1], record[2]), block_hash)

    def forget_removed(self, block_hash: Any, record: tuple) -> None:
        if self.removed_key is not None:
            self.removed_key.discard((record[1], record[2]), block_hash)

    def removed_hashes(self, parent: Any, packed: bytes) -> tuple:
        if self.removed_key is None:
            self.removed_key = MultiIndex()
            for block_hash, record in self.removed_at.items():
                self.remember_removed(block_hash, record)
        return self.removed_key.get((parent, packed))

    def child_slots(self, parent: Any, packed: bytes, parents: Sequence, tokens: Sequence) -> tuple:
        """Resident slots under `parent` holding exactly these tokens (`parents`, `tokens`: the state's columns)."""
        if self.children is None:
            self.children = MultiIndex()
            for slot in self.slot_of.values():
                self.children.add((parents[slot], tokens[slot]), slot)
        return self.children.get((parent, packed))

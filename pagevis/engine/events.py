"""Cache events: enough to replay the cache's state exactly, one event at a time."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class EventKind(str, Enum):
    ALLOCATE = "allocate"  # a free page joined a layer's block table
    WRITE = "write"  # a token's K/V was written into a slot
    EVICT = "evict"  # a policy removed a token from its slot
    RELEASE = "release"  # a page lost its last token and went back to the free list


class CacheEvent(NamedTuple):
    kind: EventKind
    step: int
    layer: int
    page: int
    slot: int  # slot within the page; -1 for page-level events (allocate, release)
    position: int  # token position; -1 for page-level events
    policy: str = ""
    reason: str = ""
    score: float = float("nan")

"""Cache events: enough to replay the cache's state exactly, one event at a time."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class EventKind(str, Enum):
    ALLOCATE = "allocate"  # a free page joined a layer's block table
    WRITE = "write"  # a token's K/V was written into a slot
    EVICT = "evict"  # a policy removed a token from its slot
    RELEASE = "release"  # a page lost its last token and went back to the free list
    SWAP_OUT = "swap_out"  # a page left its RAM frame for the disk tier (written only if dirty)
    FAULT_IN = "fault_in"  # a page was read from the disk tier into a RAM frame


class CacheEvent(NamedTuple):
    kind: EventKind
    step: int
    layer: int
    page: int  # page id (the RAM frame without a disk tier; the disk frame with one)
    slot: int  # slot within the page; -1 for page-level events (allocate, release, swap_out, fault_in)
    position: int  # token position; -1 for page-level events
    policy: str = ""
    reason: str = ""  # why a token was evicted; for swap_out / fault_in, what the move did
    score: float = float("nan")
    frame: int = -1  # the RAM frame, with a disk tier (-1: none, or no disk tier)

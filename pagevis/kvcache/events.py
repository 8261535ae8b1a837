"""Cache events: one type for everything the cache manager and the scheduler do, enough to replay the
cache's state exactly, one event at a time."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class EventKind(str, Enum):
    ALLOCATE = "allocate"  # a free page joined a sequence's block table
    WRITE = "write"  # a token's K/V was written into a slot
    EVICT = "evict"  # a policy removed a token from its slot (detail: merge: the survivor's position, else -1)
    RELEASE = "release"  # a page lost its last reference and went back to the free queue
    SWAP_OUT = "swap_out"  # a page left its RAM frame for the disk tier (written only if dirty)
    FAULT_IN = "fault_in"  # a page was read from the disk tier into a RAM frame
    # since trace version 3 (many sequences and the prefix cache in the one engine):
    SHARE = "share"  # one more block-table entry points at a page (a prefix hit or a fork); detail: ref count
    COPY_ON_WRITE = "copy_on_write"  # a shared page was copied before a change; page: the copy, detail: the source
    FORK = "fork"  # a sequence started from another's tokens; detail: the parent sequence
    PREFIX_HIT = "prefix_hit"  # a sequence found cached full pages for its prompt; detail: tokens reused
    STORE = "store"  # a full page was registered under its prefix hash (vLLM's BlockStored); detail: the hash
    UNCACHE = "uncache"  # a cached free page was reclaimed for new tokens (vLLM's BlockRemoved); detail: hash
    FREE = "free"  # a sequence finished or was cancelled: its pages were released
    PREEMPT = "preempt"  # the scheduler took a sequence's pages back to make room (it will recompute them)
    # since trace version 4 (per-head policies):
    MASK = "mask"  # a per-head policy dropped a token from one KV head (detail: the KV head); the slot stays
    # until every KV head dropped it (then an evict event frees it)
    # hybrid caches (sliding-window layers):
    SLIDE = "slide"  # a page of a local layer left the sequence: none of its tokens is in the newest query's
    # window any more (position: its newest token; detail: the tokens it held; reason names the window). A release
    # follows if no other sequence uses the page
    # compression after the prefill (kvzip):
    RECONSTRUCT = "reconstruct"  # a reconstruction pass read the sequence's cache and wrote nothing (detail: the
    # tokens it fed; reason: its chunks and time); the compression's mask and evict events follow in the same step


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
    seq: int = 0  # the sequence it happened to (or for)
    detail: int = -1  # kind-specific: see EventKind


class EventLog:
    """The cache's events as they happen: each stamped with the step the caller set and named after its sequence
    (`acting`: the sequence a change is for, which names the tier moves it causes)."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []
        self.step = 0
        self.acting = -1
        self.writes = True  # False: no WRITE events (KVCacheManager.record_writes), every other one as before

    def add(self, kind: EventKind, seq: int, layer: int = -1, page: int = -1, slot: int = -1, position: int = -1,
            policy: str = "", reason: str = "", score: float = float("nan"), frame: int = -1,
            detail: int = -1) -> None:
        self.events.append(CacheEvent(kind, self.step, layer, page, slot, position, policy, reason, score, frame,
                                      seq, detail))

    def add_write(self, seq: int, layer: int, page: int, slot: int, position: int) -> None:
        """`add` of a WRITE event (one per token and layer: the commonest, made without add's keywords), if `writes`."""
        if self.writes:
            self.events.append(as_event(CacheEvent, (WRITE, self.step, layer, page, slot, position, "", "", NAN, -1,
                                                     seq, -1)))

    def take(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self.events = self.events, []
        return events


WRITE, NAN = EventKind.WRITE, float("nan")
# as_event(CacheEvent, fields): the event of these 12 fields in CacheEvent's order, without the named tuple's
# Python-level __new__ (half the time: every token's WRITE event in every layer is made so)
as_event = tuple.__new__

"""What the Sequences window's view draws, Qt-free: one BatchRecord of the engine with the page size, every
sequence's text so far and the memory panel's rows (pages with sharing, without, contiguous reservation)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequencesStep:
    """What the view draws: one BatchRecord of the engine, the page size, and every sequence's continuation
    so far (finished ones too) as (sequence id, text)."""

    record: object
    page_size: int
    texts: tuple[tuple[int, str], ...]
    peaks: tuple[tuple[str, int], ...] = ()  # the memory rows' largest values up to this record (peak_rows)


def memory_rows(record, page_size: int) -> tuple[tuple[str, int], ...]:
    """(label, pages) for the memory panel: paged with sharing, without, contiguous reservation."""
    return (("paged, shared", record.pages_used), ("paged, no sharing", record.pages_unshared),
            ("contiguous reservation", -(-record.contiguous_reserved_tokens // page_size)))


def peak_rows(before, record, page_size: int) -> tuple[tuple[str, int], ...]:
    """memory_rows' largest values so far: those `before` it (empty at the first step) and the record's own
    (docs/sequences.md's table compares peaks)."""
    rows = memory_rows(record, page_size)
    return tuple((label, max(pages, dict(before).get(label, 0))) for label, pages in rows)

"""Cache events held compactly: one structured array row (56 bytes) per event instead of a CacheEvent
NamedTuple (about 250 bytes with its int and float objects). A 32k-token prefill writes every token into
every layer; held as tuples, a run's records grew with the context (RssAnon 2x from 4k to 32k tokens).
The array reads back as CacheEvents, one at a time, on access."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pagevis.kvcache.events import CacheEvent, EventKind

EVENT_DTYPE = np.dtype([("kind", "i1"), ("step", "i4"), ("layer", "i4"), ("page", "i4"), ("slot", "i4"),
                        ("position", "i8"), ("policy", "i2"), ("reason", "i2"), ("score", "f8"),
                        ("frame", "i4"), ("seq", "i4"), ("detail", "i8")])
KINDS = tuple(EventKind)
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}


class Strings:
    """An interning table of the texts events carry (policy names, reasons): a row holds their codes."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, text: str) -> int:
        code = self._codes.get(text)
        if code is None:
            code = self._codes[text] = len(self.texts)
            self.texts.append(text)
        return code


def to_rows(events: Iterable[CacheEvent], strings: Strings) -> np.ndarray:
    """Events as EVENT_DTYPE rows (texts interned in `strings`)."""
    if isinstance(events, EventArray):
        return events.rows if events.strings is strings else events.recoded(strings)
    code = strings.code
    return np.array([(KIND_CODES[e.kind], e.step, e.layer, e.page, e.slot, e.position, code(e.policy),
                      code(e.reason), e.score, e.frame, e.seq, e.detail) for e in events], dtype=EVENT_DTYPE)


def in_layer(events: Sequence[CacheEvent], layer: int) -> list[CacheEvent]:
    """The events of one layer; an EventArray selects its rows first instead of making every event."""
    if isinstance(events, EventArray):
        return list(EventArray(events.rows[events.rows["layer"] == layer], events.strings))
    return [e for e in events if e.layer == layer]


class EventArray(Sequence):
    """A read-only sequence of CacheEvents stored as EVENT_DTYPE rows."""

    __slots__ = ("rows", "strings")

    def __init__(self, rows: np.ndarray, strings: Strings):
        rows.flags.writeable = False
        self.rows, self.strings = rows, strings

    @classmethod
    def pack(cls, events: Iterable[CacheEvent], strings: Strings) -> EventArray:
        return cls(to_rows(events, strings), strings)

    def __len__(self) -> int:
        return len(self.rows)

    def of_kind(self, kind: EventKind) -> np.ndarray:
        """The rows of one kind of event."""
        return self.rows[self.rows["kind"] == KINDS.index(kind)]

    def recoded(self, strings: Strings) -> np.ndarray:
        """A copy of the rows with their texts coded in `strings` instead of their own table."""
        rows = self.rows.copy()
        if len(rows):
            codes = np.array([strings.code(text) for text in self.strings.texts], dtype=np.int16)
            rows["policy"] = codes[rows["policy"]]
            rows["reason"] = codes[rows["reason"]]
        return rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return EventArray(self.rows[index], self.strings)
        return self._event(self.rows[index].tolist())

    def __iter__(self):
        return map(self._event, self.rows.tolist())

    def _event(self, row) -> CacheEvent:
        kind, step, layer, page, slot, position, policy, reason, score, frame, seq, detail = row
        texts = self.strings.texts
        return CacheEvent(KINDS[kind], step, layer, page, slot, position, texts[policy], texts[reason], score, frame,
                          seq, detail)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            a == b or (a[:8] == b[:8] and a[9:] == b[9:] and a.score != a.score and b.score != b.score)
            for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # rows compare by value: unhashable, as a list is

    def __repr__(self) -> str:
        return f"EventArray({len(self)} events)"

"""The range of the event columns whose meaning depends on the event (a trace's `event_detail`, by kind) and of
`event_seq`, checked at read time against the trace's own header, as tables. (schema.check_values bounds the
other event columns: kind, step, layer, page, slot, position, frame, policy, reason.)

A bound is written as the step record's field table writes one: a number, or a symbol of the trace's sizes
(schema.check_header: T steps, L layers, P RAM pages, S page size, B page ids, N tokens, E events, H heads),
or "symbol-k" / "symbol+k". One symbol is added here: KV, the trace's KV heads (its kv_layout's n_kv_heads;
without one, its n_heads, or the most any model has when no layer's attention was recorded).

What a detail holds (kvcache/events.py) decides its bound: an index (a KV head, a page, a position, a
sequence) is bounded by what the trace has of it, so no view that loops over it (the narration's heads) or
indexes with it can be driven past the trace's own size; a count nothing iterates over (a share's reference
count, a reconstruction pass's fed tokens, a prefix hit's reused tokens) is bounded by its int32 range, not
negative; a prefix hash (store, uncache) is any 64-bit value. Kinds that carry no detail must hold -1.
"""

from __future__ import annotations

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.config import MAX_HEADS
from pagevis.trace.archive import TraceError

INT32_MAX = 2**31 - 1
Bound = int | str

# event kind -> (low, high, what the detail is) of its detail; None: any value. A kind not listed carries no
# detail (-1).
DETAIL_BOUNDS: dict[str, tuple[Bound, Bound, str] | None] = {
    EventKind.EVICT.value: (-1, "N-1", "a merge's surviving position, else -1"),
    EventKind.SHARE.value: (1, INT32_MAX, "the page's reference count"),
    EventKind.COPY_ON_WRITE.value: (0, "B-1", "the page copied from"),
    EventKind.FORK.value: (0, INT32_MAX, "the parent sequence"),
    # (a restarted session's prefix hit reuses tokens this trace never fed: not bounded by N)
    EventKind.PREFIX_HIT.value: (0, INT32_MAX, "the tokens reused"),
    EventKind.STORE.value: None,  # the page's prefix hash
    EventKind.UNCACHE.value: None,  # the prefix hash forgotten
    EventKind.MASK.value: (0, "KV-1", "the KV head that dropped the token"),
    EventKind.SLIDE.value: (0, "S", "the tokens the page held"),
    EventKind.RECONSTRUCT.value: (0, INT32_MAX, "the tokens the reconstruction pass fed"),
}
NO_DETAIL = (-1, -1, "none: this kind carries no detail")
SEQ_BOUNDS: tuple[Bound, Bound] = (0, INT32_MAX)  # event_seq: a sequence id


def limit(bound: Bound, sizes: dict[str, int]) -> int:
    """A bound with its symbol replaced by the trace's size."""
    if not isinstance(bound, str):
        return bound
    for sign in "-+":
        symbol, _, number = bound.partition(sign)
        if number:
            return sizes[symbol] + (int(number) if sign == "+" else -int(number))
    return sizes[bound]


def kv_heads(header: dict, sizes: dict[str, int]) -> int:
    layout = header.get("kv_layout") or {}
    return layout.get("n_kv_heads") or sizes["H"] or MAX_HEADS


def check_event_details(a: dict[str, np.ndarray], header: dict, sizes: dict[str, int], where: str) -> None:
    """TraceError naming the kind, the value and the range when an event's detail or sequence is out of range.
    Traces before format version 3 have neither column (their details read back as -1)."""
    if "event_detail" not in a:
        return
    sizes = {**sizes, "KV": kv_heads(header, sizes)}
    seq_low, seq_high = (limit(b, sizes) for b in SEQ_BOUNDS)
    seqs = a["event_seq"]
    if seqs.size and (seqs.min() < seq_low or seqs.max() > seq_high):
        raise TraceError(f"{where}: array 'event_seq' holds {seqs[(seqs < seq_low) | (seqs > seq_high)][0]}, "
                         f"outside {seq_low}..{seq_high}")
    kinds, details = a["event_kind"], a["event_detail"]
    for index, name in enumerate(header["event_kinds"]):
        bounds = DETAIL_BOUNDS.get(name, NO_DETAIL)
        if bounds is None:
            continue
        low, high = limit(bounds[0], sizes), limit(bounds[1], sizes)
        of_kind = details[kinds == index]
        bad = of_kind[(of_kind < low) | (of_kind > high)]
        if bad.size:
            raise TraceError(f"{where}: array 'event_detail' holds {bad[0]} for a {name!r} event, outside "
                             f"{low}..{high} ({bounds[2]})")

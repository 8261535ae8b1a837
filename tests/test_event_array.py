"""EventArray's row-level shortcuts (recoding into another text table, one layer, one kind) against the
event-by-event definitions they replace."""

import numpy as np

from pagevis.kvcache import EventKind
from pagevis.kvcache.event_array import EventArray, Strings, in_layer, to_rows
from pagevis.kvcache.events import CacheEvent


def some_events(seed: int = 0, n: int = 200) -> list[CacheEvent]:
    rng = np.random.default_rng(seed)
    kinds = list(EventKind)
    reasons = ["", "window", "lowest score", "sink kept", "réservé ✓"]
    return [CacheEvent(kinds[rng.integers(len(kinds))], int(rng.integers(-1, 50)), int(rng.integers(0, 4)),
                       int(rng.integers(0, 16)), int(rng.integers(-1, 8)), int(rng.integers(-1, 400)),
                       ["sinks", "h2o", ""][rng.integers(3)], reasons[rng.integers(len(reasons))],
                       float(rng.random()) if rng.random() < 0.8 else float("nan"), int(rng.integers(-1, 6)),
                       int(rng.integers(0, 3)), int(rng.integers(-1, 9)))
            for _ in range(n)]


def test_rows_recoded_into_another_text_table_read_back_as_the_same_events():
    events = some_events()
    source = Strings()
    for text in ("unused", "also unused"):  # codes that differ between the two tables
        source.code(text)
    packed = EventArray.pack(events, source)
    target = Strings()
    target.code("lowest score")
    rows = to_rows(packed, target)
    assert rows is not packed.rows
    read = list(EventArray(rows, target))
    for got, want in zip(read, events, strict=True):
        assert got[:8] == tuple(want[:8]) and got[9:] == tuple(want[9:])
        assert got.score == want.score or (np.isnan(got.score) and np.isnan(want.score))
    assert to_rows(packed, source) is packed.rows  # the same table: no copy
    assert len(to_rows(EventArray.pack([], source), target)) == 0


def test_one_layer_and_one_kind_select_what_a_filter_over_the_events_selects():
    events = some_events(1)
    packed = EventArray.pack(events, Strings())
    for layer in range(5):
        chosen = in_layer(packed, layer)
        assert [e._replace(score=0) for e in chosen] == [e._replace(score=0) for e in events if e.layer == layer]
        assert [e.layer for e in in_layer(events, layer)] == [layer] * sum(e.layer == layer for e in events)
    for kind in EventKind:
        assert len(packed.of_kind(kind)) == sum(e.kind is kind for e in events)

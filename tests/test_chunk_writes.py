"""A prompt chunk's K/V written by one store call (eviction.write_chunk, float32 RAM pages) leaves the cache exactly as
`append`'s token-by-token loop does: the same pages, block tables, holes, events, policy statistics and stored K/V
bit for bit, through page allocation, copy-on-write of a forked partial page, a reclaimed cached page, a sliding
window, a budget reached mid-chunk (the loop evicts the rest in) and per-head masks (the loop alone)."""

from __future__ import annotations

import numpy as np
import pytest
from test_batched_append import CONFIG, HEAD_DIM, N_KV, _cache, _state

from pagevis.kvcache import eviction

CHUNKS = (3, 5, 1, 7, 2)  # per step, every live sequence: across page boundaries and sequence 4's budget (32)


def _run(policies: dict[int, str], fast: bool, monkeypatch) -> list[tuple]:
    """The states after each step of chunks appended to sequences 1-4 (2 forked from 0: its first write copies the
    shared partial page), sequence 3 freed halfway; with `fast` False, write_chunk writes nothing (the loop does)."""
    written = []
    chunk = eviction.write_chunk

    def counted(*args):
        n = chunk(*args) if fast else 0
        written.append(n)
        return n

    monkeypatch.setattr(eviction, "write_chunk", counted)
    cache, rng, states = _cache(policies), np.random.default_rng(11), []
    live, next_position = [1, 2, 3, 4], {1: 11, 2: 9, 3: 3, 4: 28}
    for step, n in enumerate(CHUNKS):
        if step == 3:
            cache.free(3)
            live.remove(3)
        for seq_id in live:
            first = next_position[seq_id]
            cache.extend(seq_id, list(range(300 + first, 300 + first + n)))
            for layer in range(CONFIG.n_layers):
                k, v = (rng.standard_normal((n, N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
                cache.append(seq_id, layer, k, v, np.arange(first, first + n))
            next_position[seq_id] = first + n
            cache.commit(seq_id)
        states.append(_state(cache))
    monkeypatch.undo()
    if fast:  # the fast path wrote tokens, and not every one (the budget, per-head masks: the loop's)
        assert sum(written) > 0
    return states


@pytest.mark.parametrize("policies", [
    {0: "none", 1: "none", 2: "none", 3: "none", 4: "sinks"},  # sequence 4 reaches its budget mid-chunk
    {0: "none", 1: "h2o", 2: "sinks", 3: "adakv", 4: "h2o"},  # evictions at the budget, per-head masks
    {0: "none", 1: "keydiff", 2: "merge", 3: "none", 4: "keydiff"},  # statistics written with each token
])
def test_a_chunk_written_at_once_equals_the_token_by_token_loop(policies, monkeypatch):
    assert _run(policies, True, monkeypatch) == _run(policies, False, monkeypatch)


def test_write_chunk_stops_at_the_budget(monkeypatch):
    """Sequence 4 (sinks, budget 32, 28 tokens held) given 7 tokens: write_chunk writes 4, the loop evicts for 3."""
    cache = _cache({0: "none", 1: "none", 2: "none", 3: "none", 4: "sinks"})
    seen = []
    chunk = eviction.write_chunk
    monkeypatch.setattr(eviction, "write_chunk", lambda *args: seen.append(chunk(*args)) or seen[-1])
    cache.extend(4, list(range(7)))
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((7, N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
    cache.append(4, 0, k, v, np.arange(28, 35))
    assert seen == [4]
    table, store = cache.layers[0].tables[4], cache.stores[0]
    assert table.resident == 32
    written = np.flatnonzero(store.positions >= 28)
    assert sorted(store.positions[written].tolist()) == list(range(28, 35))[-len(written):]
    for flat in written:  # the K/V of each written position is its row's
        row = int(store.positions[flat]) - 28
        page, slot = divmod(int(flat), store.page_size)
        assert np.array_equal(store.k[:, page, slot], k[row]) and np.array_equal(store.v[:, page, slot], v[row])

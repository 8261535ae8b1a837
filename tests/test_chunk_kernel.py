"""kvcache/chunk_kernel.py: several sequences' chunks of queries (n_i >= 1 each) read through their block tables in
one call, against a float64 softmax over each row's visible keys (gathered here independently: resident, at or
below the row's position, above position - window), with pages anywhere, holes, a part-full last page, padding, a
row that sees no key, GQA groups and float16 pages; the same bits however the items are split (the spin pool's two
threads); and the engine's mixed steps (prompt chunks beside decoding rows) through it are each sequence's own
`attend` (paged_attention.CHUNKS_IN_ONE_CALL off).

Would fail on: a causal mask off by one (a row seeing its next key, or not its own), the window's bound, a hole or
a slot above a page's last resident one weighing anything, a query head reading another KV head, a row's output in
another row's place, the last row's weights of another row or sequence, float16 read inexactly, bits that depend on
which thread computed an item."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.kvcache.chunk_kernel import ROWS, attend_chunks


def _case(rng, n_kv, group, page_size, rows, dtype, d=16):
    """Pages in a permutation of the pool; each sequence's keys at positions 0.. in its table's slots in order but
    for holes (empty slots mid-table) and its last page part full; its rows the last of its positions."""
    frames = 64
    k = rng.standard_normal((n_kv, frames, page_size, d)).astype(dtype)
    v = rng.standard_normal((n_kv, frames, page_size, d)).astype(dtype)
    bias = np.full(frames * page_size, -np.inf, np.float32)
    key_positions = rng.integers(-5, 1000, frames * page_size)  # (empty slots' stale positions)
    pages, used, tables, positions = rng.permutation(frames), 0, [], []
    for n in rows:
        slots = n + int(rng.integers(0, 3 * page_size))  # resident keys before the rows' own, holes among them
        n_pages = -(-(slots + page_size // 2) // page_size)
        table = pages[used: used + n_pages]
        used += n_pages
        flat = (table[:, None] * page_size + np.arange(page_size)).ravel()[:slots + page_size // 2]
        resident = np.ones(len(flat), bool)
        resident[rng.choice(len(flat) - n, len(flat) - slots, replace=False)] = False  # holes, before the rows
        flat = flat[resident]
        bias[flat] = 0
        key_positions[flat] = np.arange(len(flat))
        tables.append(table)
        positions.append(np.arange(len(flat) - n, len(flat)))
    q = (2 * rng.standard_normal((sum(rows), n_kv * group, d))).astype(np.float32)
    return q, k, v, tables, bias, key_positions, np.concatenate(positions)


def _arrays(tables):
    padded = np.zeros((len(tables), max(map(len, tables))), np.int64)
    for row, table in zip(padded, tables, strict=True):
        row[:len(table)] = table
    return padded, np.array([len(t) for t in tables], np.int64)


SLOW = pytest.mark.slow  # float16 pages: their chunk kernels compile in the test (~15 s): `make test-all`


@pytest.mark.parametrize("n_kv, group, page_size, window, dtype, d", [
    (3, 3, 16, 0, np.float32, 16), (1, 4, 4, 0, np.float32, 16), (3, 3, 4, 7, np.float32, 16),
    pytest.param(1, 4, 16, 0, np.float16, 16, marks=SLOW), pytest.param(3, 3, 5, 9, np.float16, 16, marks=SLOW),
    (2, 3, 8, 0, np.float32, 24)])  # (24: no lanes)
def test_every_row_attends_over_its_sequences_visible_keys_as_float64_does(n_kv, group, page_size, window, dtype, d):
    rng = np.random.default_rng(n_kv * 100 + group * 10 + page_size + window)
    rows = [1, 2, 17, 5, 33, 1]
    q, k, v, tables, bias, key_positions, positions = _case(rng, n_kv, group, page_size, rows, dtype, d)
    starts = np.concatenate([[0], np.cumsum(rows)])
    blank = 3  # a sequence whose slots are all empty: its rows see no key
    padded, n_pages = _arrays(tables)
    bias_seen = bias.copy()
    bias_seen[(tables[blank][:, None] * page_size + np.arange(page_size)).ravel()] = -np.inf
    out, weights = attend_chunks(q, k, v, padded, n_pages, bias_seen, key_positions, positions, starts, window)
    width = padded.shape[1] * page_size
    assert out.shape == q.shape and weights.shape == (len(rows), n_kv * group, width)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)  # (float16 pages: the stored values, exactly)
    for b, table in enumerate(tables):
        flats = (table[:, None] * page_size + np.arange(page_size)).ravel()
        assert not weights[b][:, len(flats):].any(), "padding weighs exactly 0"
        for r in range(starts[b], starts[b + 1]):
            p = positions[r]
            visible = np.isfinite(bias_seen[flats]) & (key_positions[flats] <= p)
            if window:
                visible &= key_positions[flats] > p - window
            if not visible.any():
                assert not out[r].any(), "a row that sees no key gets zeros"
                if r == starts[b + 1] - 1:
                    assert not weights[b].any()
                continue
            for h in range(n_kv * group):
                keys = k64[h // group, flats // page_size, flats % page_size][visible]
                values = v64[h // group, flats // page_size, flats % page_size][visible]
                scores = keys @ q[r, h].astype(np.float64) / np.sqrt(d)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                np.testing.assert_allclose(out[r, h], w @ values, rtol=2e-5, atol=2e-6)
                if r == starts[b + 1] - 1:  # the last row's weights, over the table's flat slots
                    np.testing.assert_allclose(weights[b, h, :len(flats)][visible], w, rtol=2e-5, atol=1e-7)
                    assert not weights[b, h, :len(flats)][~visible].any(), "hidden slots weigh exactly 0"
    assert not out[starts[blank]: starts[blank + 1]].any() and not weights[blank].any()


def test_wanted_picks_the_last_rows_weights_of_those_sequences_only():
    rng = np.random.default_rng(5)
    rows = [3, 1, 20]
    q, k, v, tables, bias, key_positions, positions = _case(rng, 2, 2, 8, rows, np.float32)
    starts = np.concatenate([[0], np.cumsum(rows)])
    padded, n_pages = _arrays(tables)
    args = (q, k, v, padded, n_pages, bias, key_positions, positions, starts)
    out, every = attend_chunks(*args)
    some_out, some = attend_chunks(*args, wanted=[2, 0])
    none_out, none = attend_chunks(*args, wanted=())
    assert np.array_equal(out, some_out) and np.array_equal(out, none_out)
    assert np.array_equal(some, every[[2, 0]]) and none.shape == (0, 4, padded.shape[1] * 8)


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float16, marks=SLOW)])
def test_the_same_bits_however_the_items_are_split_and_on_the_spin_pools_two_threads(dtype):
    """Items are fixed runs of ROWS rows, each computed whole: computed one a call (as the pool's two threads take
    them) or all in one, and through the spin pool (its helper taking some), the output is one thread's bit for bit."""
    from pagevis.kvcache import chunk_kernel as kernel
    from pagevis.model import quantized, weight_threads

    rng = np.random.default_rng(9)
    rows = [40, 1, 1, 23, 2, 17, 1]  # items straddle sequences; decoding rows among them
    q, k, v, tables, bias, key_positions, positions = _case(rng, 3, 3, 16, rows, dtype, d=64)
    starts = np.concatenate([[0], np.cumsum(rows)])
    padded, n_pages = _arrays(tables)
    args = (q, k, v, padded, n_pages, bias, key_positions, positions, starts)
    one, weights = attend_chunks(*args)
    n_items = -(-len(q) // ROWS)
    kernels = kernel.kernels_for(k)
    tiles = -(-ROWS * 9 * 64 // kernel.TILE)
    arrays = (q, kernel.bits(k), kernel.bits(v), padded, n_pages, bias, key_positions, positions, starts)
    result = np.full((n_items, tiles * kernel.TILE), np.nan, np.float32)
    for i in reversed(range(n_items)):  # one item a call, last first
        kernels.items(arrays[0], np.float32(1 / 8), *arrays[1:], 0, result, i, i + 1)
    alone = result.reshape(n_items * ROWS, 9, 64)[:len(q)]
    assert np.array_equal(alone.view(np.int32), one.view(np.int32))
    weight_threads.set_weight_threads(2)
    try:
        pool = quantized.spin_pool()
        assert pool is not None
        helped = pool.stats()[0]
        for _ in range(3):  # the items fall to either thread differently each time
            got, got_weights = attend_chunks(*args, pool=pool)
            assert np.array_equal(got.view(np.int32), one.view(np.int32))
            assert np.array_equal(got_weights.view(np.int32), weights.view(np.int32))
        print("items the helper computed:", pool.stats()[0] - helped)
    finally:
        weight_threads.set_weight_threads(1)


def _staggered(monkeypatch, chunks: bool, watched: bool = False):
    """Eight greedy requests on the synthetic model sharing a system prompt (prefix hits after the first), submitted
    two a step, prompts fed in chunks of 6: steps of prompt chunks beside decoding rows. Each step's logits by request,
    the tokens, the watched layers' last-row weights, and how many layer calls took one chunk-kernel call."""
    from pagevis.engine import Engine, ModelSpec, SamplingConfig, SessionConfig
    from pagevis.kvcache import paged_attention

    monkeypatch.setattr(paged_attention, "CHUNKS_IN_ONE_CALL", chunks)
    calls = []
    real = paged_attention.attend_chunks

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(paged_attention, "attend_chunks", counted)
    model = ModelSpec(kind="synthetic").load()
    config = SessionConfig(page_size=4, max_pages=64, policy="none", max_new_tokens=6,
                           sampling=SamplingConfig(mode="greedy"))
    engine = Engine(model, config, max_chunk=6)
    system = model.tokenizer.encode("You are a helpful assistant who answers about pages and caches. ")
    prompts = [system + model.tokenizer.encode(f"Client {i} asks" + " more" * (i % 3)) for i in range(8)]
    logits, weights, ids = [], [], []
    while prompts or not engine.done:
        for prompt in prompts[:2]:
            ids.append(engine.submit(prompt, ignore_eos=True))
            if watched:
                engine.watch_attention(ids[-1], (0, 1))
        prompts = prompts[2:]
        engine.step()
        logits.append({seq: row.copy() for seq, row in engine.last_logits.items()})
        weights.append({seq: {layer: (w.copy(), None if s is None else s.copy()) for layer, (w, s) in kept.items()}
                        for seq, kept in engine.attention.items()})
    hits = sum(engine.requests[i].prefix_hit_tokens for i in ids)
    return logits, [list(engine.requests[i].generated) for i in ids], weights, sum(calls), hits


@pytest.mark.parametrize("watched", [False, True])
def test_the_engines_mixed_steps_in_one_call_are_each_sequences_own_attention(monkeypatch, watched):
    new_logits, new_tokens, new_weights, calls, hits = _staggered(monkeypatch, True, watched)
    old_logits, old_tokens, old_weights, old_calls, old_hits = _staggered(monkeypatch, False, watched)
    assert calls > 0 and old_calls == 0 and hits == old_hits > 0
    assert new_tokens == old_tokens
    assert len(new_logits) == len(old_logits)
    for new, old in zip(new_logits, old_logits, strict=True):
        assert new.keys() == old.keys()
        for seq in new:
            np.testing.assert_allclose(new[seq], old[seq], rtol=1e-5, atol=1e-5)
    for new, old in zip(new_weights, old_weights, strict=True):
        assert new.keys() == old.keys()
        for seq in new:
            assert new[seq].keys() == old[seq].keys()
            for layer, (w, slots) in new[seq].items():
                old_w, old_slots = old[seq][layer]
                assert (slots is None) == (old_slots is None) and (slots is None or np.array_equal(slots, old_slots))
                np.testing.assert_allclose(w, old_w, rtol=1e-5, atol=1e-6)

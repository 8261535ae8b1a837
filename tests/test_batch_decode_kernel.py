"""kvcache/batch_decode_kernel.py: several sequences' decode attention read through their block tables, against a
float64 softmax over each sequence's visible keys (gathered here independently), with holes, padding, a sliding
window, a sequence that sees no key, and GQA groups."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.kvcache.batch_decode_kernel import attend_tables


def _pages_and_queries(rng, n_kv, group, page_size, d, frames, batch):
    """Random K/V pages (n_kv, frames, page_size, d), queries (batch, n_kv * group, d), and each sequence's 1-4 pages
    (n_pages, tables), no page in two tables."""
    k = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    q = (3 * rng.standard_normal((batch, n_kv * group, d))).astype(np.float32)
    n_pages = rng.integers(1, 5, batch)
    tables = np.zeros((batch, n_pages.max()), np.int64)
    pages = rng.permutation(frames)
    for b, n in enumerate(np.cumsum(n_pages)):
        tables[b, :n_pages[b]] = pages[n - n_pages[b]:n]
    return k, v, q, n_pages, tables


@pytest.mark.parametrize("n_kv, group, page_size, window, d", [
    (1, 1, 1, 0, 16), (3, 3, 16, 0, 16), (2, 4, 4, 0, 16), (1, 6, 3, 5, 16), (2, 5, 7, 0, 16), (3, 3, 16, 20, 16),
    # pages of a multiple of LANES slots, heads of a multiple of LANES floats: the lanes path (_page_dots, _normalise,
    # _page_weigh) with 4 + 0, 0 + 3, 4 + 1 and 16 + 0 vectors of values a block, groups of 3 and 4
    # (kernel_intrinsics.weigh_heads3, 4), of 2, 1 and 5 (a head at a time: weigh_rows)
    (3, 3, 16, 0, 64), (2, 4, 32, 20, 48), (1, 4, 16, 0, 80), (1, 2, 16, 9, 256), (2, 1, 16, 0, 64), (1, 5, 16, 7, 32)])
def test_each_sequence_attends_over_its_own_pages_as_float64_does(n_kv, group, page_size, window, d):
    rng = np.random.default_rng(n_kv * 100 + group * 10 + page_size + d)
    frames, batch = 24, 5
    k, v, q, n_pages, tables = _pages_and_queries(rng, n_kv, group, page_size, d, frames, batch)
    bias = np.where(rng.random(frames * page_size) < 0.3, -np.inf, 0).astype(np.float32)  # per flat slot
    bias[(tables[1, :n_pages[1], None] * page_size + np.arange(page_size)).ravel()] = -np.inf  # sees no key
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    positions = rng.integers(0, frames * page_size, batch)
    out, weights = attend_tables(q, k, v, tables, n_pages, bias, key_positions, positions, window)
    assert out.shape == (batch, n_kv * group, d) and weights.shape == (batch, n_kv * group, tables.shape[1] * page_size)
    _assert_float64s(q, k, v, tables, n_pages, bias, key_positions, positions, window, out, weights)


def _assert_float64s(q, k, v, tables, n_pages, bias, key_positions, positions, window, out, weights):
    """out, weights: attend_tables' of the problem, within float32 rounding of float64 over each sequence's visible
    keys (gathered here), exactly 0 on hidden slots and padding, zeros where a sequence sees no key."""
    n_kv, _, page_size, d = k.shape
    group = q.shape[1] // n_kv
    for b in range(len(tables)):
        flats = (tables[b, :n_pages[b], None] * page_size + np.arange(page_size)).ravel()
        visible = np.isfinite(bias[flats])
        if window:
            visible &= key_positions[flats] > positions[b] - window
        assert np.all(weights[b][:, len(flats):] == 0), "padding weighs exactly 0"
        assert np.all(weights[b][:, :len(flats)][:, ~visible] == 0), "hidden slots weigh exactly 0"
        if not visible.any():
            assert not out[b].any() and not weights[b].any()
            continue
        for h in range(n_kv * group):
            keys = np.array([k[h // group, f // page_size, f % page_size] for f in flats], np.float64)[visible]
            values = np.array([v[h // group, f // page_size, f % page_size] for f in flats], np.float64)[visible]
            scores = keys @ q[b, h].astype(np.float64) / np.sqrt(d)
            w = np.exp(scores - scores.max())
            w /= w.sum()
            np.testing.assert_allclose(weights[b, h, :len(flats)][visible], w, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(out[b, h], w @ values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size, d, window", [(16, 64, 0), (32, 48, 0), (16, 80, 30)])
def test_the_lanes_path_reads_no_value_past_a_pages_last_resident_slot(page_size, d, window):
    """Pages commonly end part full (a sequence's newest): the lanes path computes the scores of a whole block of
    LANES slots (their keys read, their scores then -inf) but reads no value row past the page's last resident slot.
    NaN in every key and value of the slots past each page's last resident one: the results as float64's."""
    rng = np.random.default_rng(page_size + d)
    frames, batch = 30, 6
    k, v, q, n_pages, tables = _pages_and_queries(rng, 2, 3, page_size, d, frames, batch)
    bias = np.where(rng.random(frames * page_size) < 0.1, -np.inf, 0).astype(np.float32)  # holes
    tops = rng.integers(1, page_size + 1, frames)  # each page's last resident slot + 1
    tops[rng.random(frames) < 0.3] = page_size
    for page, top in enumerate(tops):
        bias[page * page_size + top - 1] = 0
        bias[page * page_size + top:(page + 1) * page_size] = -np.inf
        k[:, page, top:], v[:, page, top:] = np.nan, np.nan
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    positions = rng.integers(0, frames * page_size, batch)
    out, weights = attend_tables(q, k, v, tables, n_pages, bias, key_positions, positions, window)
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    _assert_float64s(q, k, v, tables, n_pages, bias, key_positions, positions, window, out, weights)


def test_the_spin_pools_two_threads_give_one_threads_bits_whoever_computes_each_sequence():
    """Two weight threads: the sequences are shared with the spin pool's helper, one a chunk, each computed whole by
    one thread; then the helper takes every sequence (the test plays it, from its scratch) and once stalls on one (the
    caller computes it again): the output and the weights bit for bit one thread's. The pool's constants are the
    kernel's."""
    from pagevis.kvcache import batch_decode_kernel as kernel
    from pagevis.model import quantized, spin_pool as sp, weight_threads

    assert (kernel.TILE, kernel.DESCRIPTOR, kernel.TILES_WORD) == (sp.TILE, sp.DESCRIPTOR, sp.TILES)
    rng = np.random.default_rng(7)
    n_kv, group, d, page_size, frames, batch = 3, 3, 64, 16, 40, 7
    k = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    n_pages = rng.integers(1, 5, batch)
    tables = np.zeros((batch, n_pages.max()), np.int64)
    for b in range(batch):
        tables[b, :n_pages[b]] = rng.choice(frames, n_pages[b], replace=False)  # shared pages too
    bias = np.where(rng.random(frames * page_size) < 0.2, -np.inf, 0).astype(np.float32)
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    positions = rng.integers(0, frames * page_size, batch)
    for window in (0, 300):
        args = (q, k, v, tables, n_pages, bias, key_positions, positions, window)
        one = attend_tables(*args)
        weight_threads.set_weight_threads(2)
        try:
            pool = quantized.spin_pool()
            assert pool is not None
            for _ in range(3):  # the sequences fall to either thread differently each time
                for got, want in zip(attend_tables(*args, pool=pool), one, strict=True):
                    assert np.array_equal(got.view(np.int32), want.view(np.int32))
        finally:
            weight_threads.set_weight_threads(1)
        width = tables.shape[1] * page_size
        tiles = -(-n_kv * group * (d + width) // kernel.TILE)
        arrays = (q, k, v, tables, n_pages, bias, key_positions, positions)
        handle = kernel._handle(arrays, np.float32(1 / np.sqrt(d)), window, tiles)
        address = kernel.FLOAT32.pool_kernel
        for stalled in (False, True):
            ctrl = sp.new_control()
            scratch, out = (np.full(batch * tiles * kernel.TILE, np.nan, np.float32) for _ in range(2))
            assert sp._post(ctrl, kernel._job(batch * tiles), 5, handle.ctypes.data, 1, out.size, scratch, address,
                            batch) == batch
            if not stalled:  # the helper takes every sequence, into its scratch
                sp.help_job(ctrl, int(ctrl[sp.NEXT]))
            ctrl[sp.NEXT] += stalled  # or claims sequence 0 and never marks it done
            sp.run(ctrl, 5, batch, out, scratch)
            assert (ctrl[sp.HELPED], ctrl[sp.TAKEN_OVER]) == ((0, 1) if stalled else (batch, 0))
            rows = out.reshape(batch, tiles * kernel.TILE)
            n_heads = n_kv * group
            assert np.array_equal(rows[:, :n_heads * d].reshape(one[0].shape).view(np.int32), one[0].view(np.int32))
            assert np.array_equal(rows[:, n_heads * d:n_heads * (d + width)].reshape(one[1].shape).view(np.int32),
                                  one[1].view(np.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_tokens_written_by_the_attention_call_are_write_rows_then_attention_bit_for_bit(threads):
    """attend_tables' `write` (each sequence's decoding token into its slot: by the kernel on one thread, by the
    caller before the pool's job on two) leaves the K/V, positions, fills and bias write_rows leaves, and attends to
    the same bits as write_rows then attend_tables; the token's own slot included."""
    from pagevis.kvcache.batch_decode_kernel import write_rows
    from pagevis.model import quantized, weight_threads

    rng = np.random.default_rng(11)
    n_kv, group, d, page_size, frames, batch = 3, 3, 64, 16, 40, 6
    k = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((batch, n_kv, d)).astype(np.float32) for _ in range(2))
    n_pages = rng.integers(1, 4, batch)
    pages = rng.permutation(frames)
    tables = np.zeros((batch, n_pages.max()), np.int64)
    for b, n in enumerate(np.cumsum(n_pages)):
        tables[b, :n_pages[b]] = pages[n - n_pages[b]:n]
    last = tables[np.arange(batch), n_pages - 1]  # each sequence's own last page: its token's slot is its first hole
    bias = np.zeros(frames * page_size, np.float32)
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    fill = np.full(frames, page_size, np.int64)
    top = rng.integers(0, page_size, batch)
    for b in range(batch):
        bias[last[b] * page_size + top[b]:(last[b] + 1) * page_size] = -np.inf
        key_positions[last[b] * page_size + top[b]:(last[b] + 1) * page_size] = -1
        fill[last[b]] = top[b]
    flats = last * page_size + top
    positions = rng.integers(frames * page_size, 2 * frames * page_size, batch)
    stores = [tuple(a.copy() for a in (k, v, key_positions, fill, bias)) for _ in range(2)]
    weight_threads.set_weight_threads(threads)
    try:
        pool = quantized.spin_pool() if threads > 1 else None
        assert (pool is None) == (threads == 1)
        sk, sv, skp, sfill, sbias = stores[0]
        write_rows(sk.reshape(n_kv, -1, d), sv.reshape(n_kv, -1, d), skp, sfill, sbias, flats, np.arange(batch),
                   new_k, new_v, positions, page_size)
        want = attend_tables(q, sk, sv, tables, n_pages, sbias, skp, positions, 0, pool)
        hk, hv, hkp, hfill, hbias = stores[1]
        got = attend_tables(q, hk, hv, tables, n_pages, hbias, hkp, positions, 0, pool, (flats, new_k, new_v, hfill))
    finally:
        weight_threads.set_weight_threads(1)
    for a, b in zip(stores[0], stores[1], strict=True):
        assert np.array_equal(a, b)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.view(np.int32), w.view(np.int32))
    assert all(want[1][b, :, (n_pages[b] - 1) * page_size + top[b]].all() for b in range(batch))  # (each weighs its own)

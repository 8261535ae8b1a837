"""kvcache/batch_decode_kernel.py: several sequences' decode attention read through their block tables, against a
float64 softmax over each sequence's visible keys (gathered here independently), with holes, padding, a sliding
window, a sequence that sees no key, and GQA groups."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.kvcache.batch_decode_kernel import attend_tables


@pytest.mark.parametrize("n_kv, group, page_size, window", [(1, 1, 1, 0), (3, 3, 16, 0), (2, 4, 4, 0), (1, 6, 3, 5),
                                                            (2, 5, 7, 0), (3, 3, 16, 20)])
def test_each_sequence_attends_over_its_own_pages_as_float64_does(n_kv, group, page_size, window):
    rng = np.random.default_rng(n_kv * 100 + group * 10 + page_size)
    d, frames, batch = 16, 24, 5
    k = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, frames, page_size, d)).astype(np.float32)
    q = (3 * rng.standard_normal((batch, n_kv * group, d))).astype(np.float32)
    n_pages = rng.integers(1, 5, batch)
    tables = np.zeros((batch, n_pages.max()), np.int64)
    pages = rng.permutation(frames)
    for b, n in enumerate(np.cumsum(n_pages)):
        tables[b, :n_pages[b]] = pages[n - n_pages[b]:n]
    bias = np.where(rng.random(frames * page_size) < 0.3, -np.inf, 0).astype(np.float32)  # per flat slot
    bias[(tables[1, :n_pages[1], None] * page_size + np.arange(page_size)).ravel()] = -np.inf  # sees no key
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    positions = rng.integers(0, frames * page_size, batch)
    out, weights = attend_tables(q, k, v, tables, n_pages, bias, key_positions, positions, window)
    assert out.shape == (batch, n_kv * group, d) and weights.shape == (batch, n_kv * group, tables.shape[1] * page_size)
    for b in range(batch):
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

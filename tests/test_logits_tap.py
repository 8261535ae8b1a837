"""The one logits-keeping model wrapper (the A/B pair's and the quality bench's): what it returns is what the
model returns, what it keeps is every forward's logits, and in pieces it equals one call."""

from __future__ import annotations

import numpy as np

from pagevis.engine.logits_tap import LogitsTap
from pagevis.model import DenseAttention
from pagevis.model.synthetic import SyntheticModel

ATOL = 2e-5  # float32 results of the same maths in a different grouping


def _model_and_ids():
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, seed=5)
    return model, np.array(model.tokenizer.encode("pages in pieces"))


def test_without_pieces_it_keeps_what_each_forward_returned_until_cleared():
    model, ids = _model_and_ids()
    tap = LogitsTap(model)
    assert tap.config is model.config and tap.tokenizer is model.tokenizer
    attention = DenseAttention(model.config)
    first = tap.forward(ids[:4], np.arange(4), attention)
    second = tap.forward(ids[4:6], np.arange(4, 6), attention, all_logits=True)
    assert first.shape == (256,) and second.shape == (2, 256)
    assert tap.logits[0] is first and tap.logits[1] is second
    tap.clear()
    assert tap.logits == []


def test_in_pieces_it_keeps_every_token_and_returns_the_rows_asked_for():
    model, ids = _model_and_ids()
    positions = np.arange(len(ids))
    at_once = model.forward(ids, positions, DenseAttention(model.config), all_logits=True)
    tap = LogitsTap(model, piece=3)
    last = tap.forward(ids, positions, DenseAttention(model.config))
    np.testing.assert_allclose(tap.logits[-1], at_once, rtol=0, atol=ATOL)
    np.testing.assert_allclose(last, at_once[-1], rtol=0, atol=ATOL)
    rows = tap.forward(ids, positions, DenseAttention(model.config), logit_rows=np.array([0, 5]))
    np.testing.assert_allclose(rows, at_once[[0, 5]], rtol=0, atol=ATOL)
    assert len(tap.logits) == 2

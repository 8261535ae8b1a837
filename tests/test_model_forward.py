"""The shared Llama forward pass on synthetic models: the attend() seam, RoPE, batching, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagevis.model import DenseAttention, ModelConfigError
from pagevis.model.layers import rms_norm
from pagevis.model.rope import apply_rope, inverse_frequencies, rope_tables
from pagevis.model.synthetic import SyntheticModel

ATOL = 2e-5  # float32 results of the same maths in a different grouping


def _rope_float64(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Independent formula: pair (x[2i], x[2i+1]) rotated by pos * base**(-2i/d), in float64."""
    x = x.astype(np.float64)
    out = np.empty_like(x)
    d = x.shape[-1]
    for t, pos in enumerate(positions):
        for i in range(d // 2):
            theta = pos * base ** (-2.0 * i / d)
            a, b = x[t, :, 2 * i], x[t, :, 2 * i + 1]
            out[t, :, 2 * i] = a * np.cos(theta) - b * np.sin(theta)
            out[t, :, 2 * i + 1] = a * np.sin(theta) + b * np.cos(theta)
    return out


def _apply(x, positions, base=10000.0):
    cos, sin = rope_tables(positions, inverse_frequencies(x.shape[-1], base))
    return apply_rope(x.astype(np.float32), cos, sin)


def test_rope_rotates_adjacent_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16))
    positions = np.array([0, 1, 7, 8191, 20000])
    got = _apply(x, positions, base=100000.0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _rope_float64(x, positions, 100000.0), rtol=0, atol=3e-5)


def test_rope_on_gguf_layout_equals_rotate_half_on_hf_layout():
    """Why no un-permuting is needed: GGUF dim 2i is HF dim i, and 2i+1 is HF dim i + d/2."""
    rng = np.random.default_rng(1)
    d = 8
    hf = rng.standard_normal((3, 2, d))
    positions = np.array([0, 5, 300])
    theta = positions[:, None, None] * inverse_frequencies(d, 10000.0)[None, None, :]
    cos, sin = np.concatenate([np.cos(theta)] * 2, -1), np.concatenate([np.sin(theta)] * 2, -1)
    rotate_half = np.concatenate([-hf[..., d // 2:], hf[..., :d // 2]], -1)
    hf_rotated = hf * cos + rotate_half * sin
    to_gguf = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], -1).reshape(-1)
    np.testing.assert_allclose(_apply(hf[..., to_gguf], positions), hf_rotated[..., to_gguf], atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 3000))
def test_rope_scores_depend_only_on_relative_position(p, q, shift):
    rng = np.random.default_rng(p * 7 + q)
    a, b = rng.standard_normal((2, 1, 1, 32))
    score = (_apply(a, np.array([p])) * _apply(b, np.array([q]))).sum()
    shifted = (_apply(a, np.array([p + shift])) * _apply(b, np.array([q + shift]))).sum()
    assert score == pytest.approx(shifted, abs=2e-3)


def test_rms_norm_stays_float32():
    x = np.random.default_rng(0).standard_normal((2, 8), dtype=np.float32)
    out = rms_norm(x, np.ones(8, np.float32), np.float32(1e-5))
    assert out.dtype == np.float32
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_prefill_equals_token_by_token_and_chunks(n_heads, n_kv_heads):
    model = SyntheticModel(n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, seed=2)
    ids = np.array(model.tokenizer.encode("paged attention!"))
    positions = np.arange(len(ids))
    at_once = model.forward(ids, positions, DenseAttention(model.config), all_logits=True)
    assert at_once.shape == (len(ids), 256) and at_once.dtype == np.float32

    attention = DenseAttention(model.config)
    stepwise = np.stack([model.forward(ids[i:i + 1], positions[i:i + 1], attention) for i in range(len(ids))])
    np.testing.assert_allclose(stepwise, at_once, rtol=0, atol=ATOL)

    attention = DenseAttention(model.config)
    model.forward(ids[:5], positions[:5], attention)
    chunk = model.forward(ids[5:], positions[5:], attention, all_logits=True)
    np.testing.assert_allclose(chunk, at_once[5:], rtol=0, atol=ATOL)
    last = model.forward(ids, positions, DenseAttention(model.config))
    assert last.shape == (256,)
    np.testing.assert_allclose(last, at_once[-1], rtol=0, atol=ATOL)


def test_attend_receives_the_documented_arrays():
    model = SyntheticModel(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, seed=4)
    dense = DenseAttention(model.config)
    calls = []

    def spy(layer, q, k, v, positions):
        calls.append((layer, q, k, v, positions))
        return dense(layer, q, k, v, positions)

    model.forward(np.array([1, 2, 3]), np.array([10, 11, 12]), spy)
    assert [c[0] for c in calls] == [0, 1]
    for _, q, k, v, positions in calls:
        assert q.shape == (3, 6, 8) and k.shape == v.shape == (3, 2, 8)
        assert q.dtype == k.dtype == v.dtype == np.float32
        assert positions.dtype == np.int64 and positions.tolist() == [10, 11, 12]
    # Layer 0 input is the embedding, so its K and V can be recomputed: RoPE on K, none on V.
    layer = model.weights.layers[0]
    h = rms_norm(model.weights.embedding[[1, 2, 3]], layer.attn_norm, np.float32(model.config.rms_eps))
    kv = (h @ layer.wqkv)[:, 48:]
    np.testing.assert_allclose(calls[0][3], kv[:, 16:].reshape(3, 2, 8), atol=1e-6)
    np.testing.assert_allclose(calls[0][2], _apply(kv[:, :16].reshape(3, 2, 8), np.array([10, 11, 12])), atol=1e-5)


def test_attend_with_wrong_output_shape_is_reported():
    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"attend returned shape \(1, 1, 4\)"):
        model.forward(np.array([1]), np.array([0]), lambda layer, q, k, v, p: v)


def test_dense_attention_matches_float64_softmax():
    model = SyntheticModel(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 4, 8), dtype=np.float32)
    k = rng.standard_normal((4, 2, 8), dtype=np.float32)
    v = rng.standard_normal((4, 2, 8), dtype=np.float32)
    out = DenseAttention(model.config)(0, q, k, v, np.arange(4))
    for t in range(4):
        for h in range(4):
            scores = k[:t + 1, h // 2].astype(np.float64) @ q[t, h] / np.sqrt(8)
            weights = np.exp(scores - scores.max())
            expected = (weights / weights.sum()) @ v[:t + 1, h // 2]
            np.testing.assert_allclose(out[t, h], expected, atol=1e-5)


def test_positions_beyond_the_trained_context_still_work():
    model = SyntheticModel(n_layers=1, context_length=16)
    logits = model.forward(np.array([65, 66]), np.array([1_000_000, 1_000_001]), DenseAttention(model.config))
    assert np.isfinite(logits).all()


def test_seed_decides_the_weights():
    def logits(seed):
        model = SyntheticModel(n_layers=1, seed=seed)
        return model.forward(np.array([1, 2]), np.arange(2), DenseAttention(model.config))

    np.testing.assert_array_equal(logits(7), logits(7))
    assert not np.allclose(logits(7), logits(8))


def test_synthetic_text_round_trips_through_its_byte_tokenizer():
    model = SyntheticModel(n_layers=1)
    assert model.tokenizer.decode(model.tokenizer.encode("naïve 東京")) == "naïve 東京"
    assert model.config.eos_ids == () and model.config.bos_id is None


@pytest.mark.parametrize("kwargs,field,allowed", [
    ({"n_heads": 6, "n_kv_heads": 4}, "n_heads", "multiple of n_kv_heads"),
    ({"n_layers": 0}, "n_layers", "positive integer"),
    ({"head_dim": -8}, "head_dim", "positive integer"),
    ({"n_heads": 2.5}, "n_heads", "positive integer"),
    ({"n_kv_heads": True}, "n_kv_heads", "positive integer"),
    ({"head_dim": 7}, "head_dim", "even"),
    ({"vocab_size": 100}, "vocab_size", "at least 256"),
    ({"d_model": "big"}, "d_model", "positive integer"),
    ({"rms_eps": 0.0}, "rms_eps", "positive"),
])
def test_synthetic_model_validates_its_parameters(kwargs, field, allowed):
    with pytest.raises(ModelConfigError, match=allowed) as caught:
        SyntheticModel(**kwargs)
    assert caught.value.field == field
    assert repr(caught.value.value) in str(caught.value)


def test_forward_rejects_bad_inputs():
    model = SyntheticModel(n_layers=1)
    attention = DenseAttention(model.config)
    with pytest.raises(ValueError, match="token ids must be in"):
        model.forward(np.array([256]), np.array([0]), attention)
    with pytest.raises(ValueError, match="2 token ids but 1 positions"):
        model.forward(np.array([1, 2]), np.array([0]), attention)
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(np.array([], dtype=np.int64), np.array([], dtype=np.int64), attention)


@pytest.mark.parametrize("window", [0, 24])
def test_dense_attention_on_two_threads_is_its_float64_softmax_row_by_row(window, monkeypatch):
    """A prefill's queries split over the weight threads (both halves, the sliding window's mask too) give every
    row what one thread gives, within float32 rounding, and that is the float64 softmax over the keys each query
    may see. Not bit for bit: OpenBLAS's Haswell sgemm (what it picks on this machine kind's AMD EPYC) rounds a row
    by the rows beside it (a 32-row product's rows differ from the same rows of a 64-row one in the last bit)."""
    from pagevis.model import weight_threads

    model = SyntheticModel(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, sliding_window=window,
                           global_every=0)
    rng = np.random.default_rng(6)
    n = 64
    q, k, v = (rng.standard_normal((n, h, 8), dtype=np.float32) for h in (4, 2, 2))
    monkeypatch.setattr(weight_threads, "MIN_SPLIT_BYTES", 0)
    weight_threads.set_weight_threads(2)
    try:
        two = DenseAttention(model.config)(0, q, k, v, np.arange(n))
    finally:
        weight_threads.set_weight_threads(1)
    one = DenseAttention(model.config)(0, q, k, v, np.arange(n))
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-6)
    for t in range(n):
        first = max(0, t - window + 1) if window else 0
        for h in range(4):
            scores = k[first:t + 1, h // 2].astype(np.float64) @ q[t, h] / np.sqrt(8)
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(two[t, h], (weights / weights.sum()) @ v[first:t + 1, h // 2], atol=1e-5)

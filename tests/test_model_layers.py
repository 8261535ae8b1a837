"""The layer kit and the layouts (Qwen 2 / Qwen 3 / Gemma 3 wiring) against a float64 reference written here,
sharing no code with pagevis/model: every option the architectures use, per-layer RoPE bases, linear RoPE
scales and windows."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.errors import ConfigError
from pagevis.model import DenseAttention, DecoderModel
from pagevis.model.architectures.gemma3 import settings as gemma3_settings
from pagevis.model.config import Layout, ModelConfig
from pagevis.model.layers import gelu_tanh_mul
from pagevis.model.rope import apply_rope_neox, inverse_frequencies, rope_tables
from pagevis.model.weights import DecoderWeights, layer_from_gguf_matrices

D, HEADS, KV, HD, FF, VOCAB, LAYERS = 24, 4, 2, 8, 40, 50, 3
GEMMA_LIKE = Layout(rope_neox=True, qk_norm=True, post_norms=True, activation="gelu_tanh",
                    embedding_scale=float(np.sqrt(D)), query_scale=0.2, logit_softcap=7.0)


def test_neox_rope_rotates_halves():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, HD)).astype(np.float32)
    positions = np.arange(5) * 7
    cos, sin = rope_tables(positions, inverse_frequencies(HD, 10000.0))
    got = apply_rope_neox(x, cos, sin)
    angles = positions[:, None] * 10000.0 ** (-np.arange(0, HD, 2) / HD)  # (n, half)
    c, s = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    first, second = x[..., :HD // 2].astype(np.float64), x[..., HD // 2:].astype(np.float64)
    expected = np.concatenate([first * c - second * s, second * c + first * s], axis=-1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_gelu_tanh_matches_its_formula():
    gate = np.linspace(-6, 6, 101, dtype=np.float32)
    up = np.linspace(2, -1, 101, dtype=np.float32)
    g = gate.astype(np.float64)
    expected = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * up
    np.testing.assert_allclose(gelu_tanh_mul(gate, up), expected, rtol=1e-5, atol=1e-6)


def test_gemma3_pattern_every_sixth_layer_is_global():
    value = lambda key, kind="int", default=None: {"attention.sliding_window": 512}[key]
    fields = gemma3_settings(value, {"n_layers": 18, "d_model": 640, "n_heads": 4, "head_dim": 256,
                                     "rope_base": 1e6, "rope_scale": 8.0})
    assert [i for i, w in enumerate(fields["sliding_windows"]) if w is None] == [5, 11, 17]
    assert set(fields["sliding_windows"]) == {512, None}
    assert [b for b in fields["rope_bases"]] == [1e6 if i in (5, 11, 17) else 1e4 for i in range(18)]
    assert fields["rope_scales"] == tuple(8.0 if i in (5, 11, 17) else 1.0 for i in range(18))  # global layers only
    assert fields["layout"].query_scale == pytest.approx(1 / 16)
    assert fields["layout"].embedding_scale == pytest.approx(np.sqrt(640))


def test_per_layer_fields_must_have_one_entry_per_layer():
    with pytest.raises(ConfigError, match="sliding_windows.*one entry per layer \\(3\\)"):
        _config(Layout(), sliding_windows=(4, None))
    with pytest.raises(ConfigError, match="activation"):
        Layout(activation="relu")


@pytest.mark.parametrize("layout", [Layout(), Layout(rope_neox=True, qkv_bias=True),
                                    Layout(rope_neox=True, qk_norm=True), GEMMA_LIKE], ids=str)
def test_layouts_equal_a_float64_reference(layout):
    config = _config(layout, sliding_windows=(3, None, 3) if layout.post_norms else (),
                     rope_bases=(100.0, 1000.0, 100.0) if layout.post_norms else (),
                     rope_scales=(1.0, 8.0, 1.0) if layout.post_norms else ())
    model = DecoderModel(config, _random_weights(config, seed=1), tokenizer=None)
    ids = np.array([3, 14, 15, 9, 26, 5, 35, 8])
    got = model.forward(ids, np.arange(8), DenseAttention(config), all_logits=True)
    np.testing.assert_allclose(got, _reference_logits(config, model.weights, ids), rtol=2e-4, atol=2e-4)
    # decoding token by token (the window now cuts through earlier calls' keys) gives the same last logits
    attend = DenseAttention(config)
    for position, token in enumerate(ids):
        step = model.forward(ids[position:position + 1], np.array([position]), attend)
    np.testing.assert_allclose(step, got[-1], rtol=2e-4, atol=2e-4)


def test_the_window_changes_the_answer():
    """Not a no-op: a window of 3 on every layer gives other logits than full attention, past position 3."""
    windowed = _config(GEMMA_LIKE, sliding_windows=(3, 3, 3))
    full = _config(GEMMA_LIKE)
    weights = _random_weights(full, seed=1)
    ids = np.arange(8)
    a = DecoderModel(windowed, weights, None).forward(ids, ids, DenseAttention(windowed), all_logits=True)
    b = DecoderModel(full, weights, None).forward(ids, ids, DenseAttention(full), all_logits=True)
    np.testing.assert_allclose(a[:3], b[:3], rtol=1e-5, atol=1e-5)
    assert np.abs(a[3:] - b[3:]).max() > 1e-2


def _config(layout: Layout, **fields) -> ModelConfig:
    return ModelConfig(name="tiny", n_layers=LAYERS, d_model=D, n_heads=HEADS, n_kv_heads=KV, head_dim=HD, d_ff=FF,
                       vocab_size=VOCAB, rope_base=10000.0, rms_eps=1e-6, context_length=64, bos_id=None, eos_ids=(),
                       layout=layout, **fields)


def _random_weights(config: ModelConfig, seed: int) -> DecoderWeights:
    rng = np.random.default_rng(seed)
    layout = config.layout
    m = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
    v = lambda n: (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    q, kv = config.q_dim, config.kv_dim
    layers = []
    for _ in range(config.n_layers):
        extra = {}
        if layout.qkv_bias:
            extra.update(q_bias=v(q) - 1, k_bias=v(kv) - 1, v_bias=v(kv) - 1)
        if layout.qk_norm:
            extra.update(q_norm=v(HD), k_norm=v(HD))
        if layout.post_norms:
            extra.update(post_attn_norm=v(D), post_ffn_norm=v(D))
        layers.append(layer_from_gguf_matrices(v(D), m(q, D), m(kv, D), m(kv, D), m(D, q), v(D), m(FF, D), m(FF, D),
                                               m(D, FF), **extra))
    embedding = rng.standard_normal((VOCAB, D)).astype(np.float32)
    return DecoderWeights(embedding, tuple(layers), v(D), embedding.T)


def _norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate(x, positions, base, neox):
    """x (n, heads, hd) float64; llama pairs (2i, 2i+1), NEOX pairs (i, i + hd/2)."""
    half = x.shape[-1] // 2
    angles = positions[:, None, None] * base ** (-np.arange(half) * 2 / x.shape[-1])
    c, s = np.cos(angles), np.sin(angles)
    if neox:
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _reference_logits(config: ModelConfig, weights: DecoderWeights, ids: np.ndarray) -> np.ndarray:
    layout, eps, n = config.layout, config.rms_eps, len(ids)
    positions = np.arange(n, dtype=np.float64)
    x = weights.embedding[ids].astype(np.float64) * layout.embedding_scale
    scale = layout.query_scale or 1 / np.sqrt(HD)
    for index, layer in enumerate(weights.layers):
        h = _norm(x, layer.attn_norm, eps)
        qkv = h @ layer.wqkv.astype(np.float64) + (0 if layer.qkv_bias is None else layer.qkv_bias)
        q = qkv[:, :config.q_dim].reshape(n, HEADS, HD)
        k = qkv[:, config.q_dim:config.q_dim + config.kv_dim].reshape(n, KV, HD)
        v = qkv[:, config.q_dim + config.kv_dim:].reshape(n, KV, HD)
        if layout.qk_norm:
            q, k = _norm(q, layer.q_norm, eps), _norm(k, layer.k_norm, eps)
        base, turned = config.rope_bases[index], positions / config.rope_scales[index]  # linear scaling
        q, k = _rotate(q, turned, base, layout.rope_neox), _rotate(k, turned, base, layout.rope_neox)
        window = config.sliding_windows[index] or n
        out = np.empty((n, HEADS, HD))
        for head in range(HEADS):
            kv_head = head // (HEADS // KV)
            for i in range(n):
                keys = range(max(0, i - window + 1), i + 1)
                scores = np.array([q[i, head] @ k[j, kv_head] * scale for j in keys])
                p = np.exp(scores - scores.max())
                out[i, head] = (p / p.sum()) @ v[list(keys), kv_head]
        o = out.reshape(n, -1) @ layer.wo.astype(np.float64)
        x = x + (_norm(o, layer.post_attn_norm, eps) if layout.post_norms else o)
        gate_up = _norm(x, layer.ffn_norm, eps) @ layer.w_gate_up.astype(np.float64)
        g, u = gate_up[:, :FF], gate_up[:, FF:]
        act = (0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if layout.activation == "gelu_tanh"
               else g / (1 + np.exp(-g)))
        down = (act * u) @ layer.w_down.astype(np.float64)
        x = x + (_norm(down, layer.post_ffn_norm, eps) if layout.post_norms else down)
    logits = _norm(x, weights.output_norm, eps) @ weights.output_t.astype(np.float64)
    cap = layout.logit_softcap
    return logits if cap is None else cap * np.tanh(logits / cap)

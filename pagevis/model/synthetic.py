"""A seeded random model of the Llama architecture, for tests and demos without a model file."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagevis.model.byte_tokenizer import ByteTokenizer
from pagevis.errors import check_int
from pagevis.model.config import LIMITS, ModelConfig, check_positive_int
from pagevis.model.errors import ModelConfigError
from pagevis.model.decoder import DecoderModel
from pagevis.model.weights import DecoderWeights, layer_from_gguf_matrices

BYTE_VOCAB = 256
MAX_WINDOW = 1 << 20
MAX_LAYERS = LIMITS["n_layers"]


def window_pattern(n_layers: int, window: int, global_every: int) -> tuple[int | None, ...] | None:
    """Per layer, `window` or None: every `global_every`-th layer global (Gemma 3: 6, so layers 5, 11, 17 of 18),
    the rest local; global_every 0 makes every layer local. window 0: no sliding window (None)."""
    check_int("sliding_window", window, 0, MAX_WINDOW)
    check_int("global_every", global_every, 0, MAX_LAYERS)
    if not window:
        return None
    return tuple(None if global_every and (layer + 1) % global_every == 0 else window for layer in range(n_layers))


class SyntheticModel(DecoderModel):
    """DecoderModel with random weights (same forward code as the real model).

    Its tokenizer is a ByteTokenizer: token id == UTF-8 byte, so text round-trips; ids >= 256 (if
    vocab_size is larger) decode to nothing. It has no BOS and no EOS (eos_ids == ()).
    Weights are N(0, 1/fan_in) so activations keep unit scale; norms are ones; the tied output
    matrix is scaled so that logits have a standard deviation of about 2.
    """

    def __init__(
        self,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        head_dim: int = 16,
        d_model: int | None = None,
        vocab_size: int = BYTE_VOCAB,
        d_ff: int | None = None,
        rope_base: float = 10000.0,
        rms_eps: float = 1e-5,
        context_length: int = 2048,
        seed: int = 0,
        sliding_window: int = 0,
        global_every: int = 0,
    ) -> None:
        config = synthetic_config(n_layers, n_heads, n_kv_heads, head_dim, d_model, vocab_size, d_ff,
                                  rope_base, rms_eps, context_length, sliding_window, global_every)
        super().__init__(config, random_weights(config, seed), ByteTokenizer(vocab_size))
        self.seed = seed


def synthetic_config(
    n_layers: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any, d_model: Any, vocab_size: Any,
    d_ff: Any, rope_base: Any, rms_eps: Any, context_length: Any, sliding_window: Any = 0, global_every: Any = 0,
) -> ModelConfig:
    for field, value in (("n_layers", n_layers), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
                         ("head_dim", head_dim), ("vocab_size", vocab_size),
                         ("context_length", context_length)):
        check_positive_int(field, value)
    if vocab_size < BYTE_VOCAB:
        raise ModelConfigError("vocab_size", vocab_size, f"at least {BYTE_VOCAB} (one token per byte)")
    d_model = n_heads * head_dim if d_model is None else check_positive_int("d_model", d_model)
    d_ff = 2 * d_model if d_ff is None else check_positive_int("d_ff", d_ff)
    windows = window_pattern(int(n_layers), sliding_window, global_every)
    pattern = "" if windows is None else f"-w{sliding_window}g{global_every}"
    return ModelConfig(
        name=f"synthetic-{n_layers}L-{n_heads}h{n_kv_heads}kv-{head_dim}d{pattern}",
        n_layers=int(n_layers), d_model=d_model, n_heads=int(n_heads), n_kv_heads=int(n_kv_heads),
        head_dim=int(head_dim), d_ff=d_ff, vocab_size=int(vocab_size), rope_base=float(rope_base),
        rms_eps=float(rms_eps), context_length=int(context_length), bos_id=None, eos_ids=(), sliding_windows=windows or (),
    )


def random_weights(config: ModelConfig, seed: int) -> DecoderWeights:
    rng = np.random.default_rng(seed)
    d, q, kv, ff = config.d_model, config.q_dim, config.kv_dim, config.d_ff

    def matrix(out_features: int, in_features: int) -> np.ndarray:
        scale = np.float32(1 / np.sqrt(in_features))
        return rng.standard_normal((out_features, in_features), dtype=np.float32) * scale

    def ones() -> np.ndarray:
        return np.ones(d, dtype=np.float32)

    layers = tuple(
        layer_from_gguf_matrices(ones(), matrix(q, d), matrix(kv, d), matrix(kv, d), matrix(d, q),
                                 ones(), matrix(ff, d), matrix(ff, d), matrix(d, ff))
        for _ in range(config.n_layers)
    )
    # Tied embedding/output, scaled so logits have a standard deviation near 2: peaked enough to have
    # a clear greedy choice, flat enough that the oracle's KL and perplexity say something.
    output_t = rng.standard_normal((d, config.vocab_size), dtype=np.float32) * np.float32(2 / np.sqrt(d))
    embedding = np.ascontiguousarray(output_t.T)  # output-major, as the loader lays out tied weights
    return DecoderWeights(embedding, layers, ones(), embedding.T)

"""Weights laid out for `x @ W` products: float32 matrices of shape (in_features, out_features) that are
transposed views of output-major (out_features, in_features) C-contiguous arrays, GGUF's own orientation.
A run of output columns is then contiguous, which the blocked small-batch product needs (see matmul.py),
and gemm reads the same array through BLAS's transpose flag: one copy serves both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np

from pagevis.model.config import ModelConfig


class PackedRows(Protocol):
    """An embedding held packed (quant_weights.QuantEmbedding): `rows[ids]` dequantises those rows."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, ids: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Q and K columns are in GGUF order (see rope.py). Each matrix is the
    (in, out) view of an output-major array (`matrix.T` is C-contiguous)."""

    attn_norm: np.ndarray  # (d_model,)
    wqkv: np.ndarray       # (d_model, q_dim + 2 * kv_dim): Q, K, V side by side
    wo: np.ndarray         # (q_dim, d_model)
    ffn_norm: np.ndarray   # (d_model,)
    w_gate_up: np.ndarray  # (d_model, 2 * d_ff): gate, up side by side
    w_down: np.ndarray     # (d_ff, d_model)
    # Only in the layouts that have them (config.Layout), else None:
    qkv_bias: np.ndarray | None = None       # (q_dim + 2 * kv_dim,): qkv_bias
    q_norm: np.ndarray | None = None         # (head_dim,): qk_norm
    k_norm: np.ndarray | None = None         # (head_dim,)
    post_attn_norm: np.ndarray | None = None  # (d_model,): post_norms
    post_ffn_norm: np.ndarray | None = None   # (d_model,)

    def vectors(self) -> tuple[np.ndarray, ...]:
        """Every norm weight and bias this layer has."""
        return tuple(v for v in (self.attn_norm, self.ffn_norm, self.qkv_bias, self.q_norm, self.k_norm,
                                 self.post_attn_norm, self.post_ffn_norm) if v is not None)


@dataclass(frozen=True)
class DecoderWeights:
    embedding: np.ndarray | PackedRows  # (vocab, d_model), C-contiguous, or its packed rows (quant_weights)
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray  # (d_model,)
    output_t: np.ndarray   # (d_model, vocab): with tied weights embedding.T, else another output-major view

    def matrices(self) -> list[np.ndarray]:
        """Every matrix a forward pass multiplies by, as (in, out) views, in the order a step reads them."""
        return [w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [
            self.output_t]

    def nbytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every matrix once, one embedding row."""
        layer_bytes = sum(
            w.nbytes for layer in self.layers
            for w in (*layer.vectors(), layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
        )
        return layer_bytes + self.output_norm.nbytes + self.output_t.nbytes + self.embedding[0].nbytes


def as_input_major(*out_by_in: np.ndarray) -> np.ndarray:
    """Stack (out, in) matrices, as stored in GGUF, into one C-contiguous (sum of out, in) array and
    return its (in, sum of out) transposed view."""
    return np.ascontiguousarray(np.concatenate(out_by_in, axis=0), dtype=np.float32).T


def layer_from_gguf_matrices(
    attn_norm: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray,
    ffn_norm: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
    q_bias: np.ndarray | None = None, k_bias: np.ndarray | None = None, v_bias: np.ndarray | None = None,
    q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
    post_attn_norm: np.ndarray | None = None, post_ffn_norm: np.ndarray | None = None,
) -> LayerWeights:
    """Build a layer from matrices in GGUF/PyTorch orientation (out_features, in_features); the optional
    biases and norms only for the layouts that have them (the three biases together)."""
    return LayerWeights(
        attn_norm=_vector(attn_norm),
        wqkv=as_input_major(q, k, v),
        wo=as_input_major(o),
        ffn_norm=_vector(ffn_norm),
        w_gate_up=as_input_major(gate, up),
        w_down=as_input_major(down),
        qkv_bias=None if q_bias is None else _vector(np.concatenate([q_bias, k_bias, v_bias])),
        q_norm=_vector(q_norm), k_norm=_vector(k_norm),
        post_attn_norm=_vector(post_attn_norm), post_ffn_norm=_vector(post_ffn_norm),
    )


@overload
def _vector(values: np.ndarray) -> np.ndarray: ...
@overload
def _vector(values: None) -> None: ...
def _vector(values: np.ndarray | None) -> np.ndarray | None:
    return None if values is None else np.array(values, dtype=np.float32)  # a copy: never a file view


def check_weight_shapes(config: ModelConfig, weights: DecoderWeights) -> None:
    """Raise ValueError naming the first array whose shape disagrees with config."""
    d, q, kv, ff, vocab = config.d_model, config.q_dim, config.kv_dim, config.d_ff, config.vocab_size
    expected: dict[str, tuple[np.ndarray | PackedRows, tuple[int, ...]]] = {
        "embedding": (weights.embedding, (vocab, d)),
        "output_norm": (weights.output_norm, (d,)),
        "output_t": (weights.output_t, (d, vocab)),
    }
    if len(weights.layers) != config.n_layers:
        raise ValueError(f"{len(weights.layers)} layers of weights, config says {config.n_layers}")
    layout, hd = config.layout, config.head_dim
    optional = {"qkv_bias": (layout.qkv_bias, (q + 2 * kv,)), "q_norm": (layout.qk_norm, (hd,)),
                "k_norm": (layout.qk_norm, (hd,)), "post_attn_norm": (layout.post_norms, (d,)),
                "post_ffn_norm": (layout.post_norms, (d,))}
    for index, layer in enumerate(weights.layers):
        expected.update({
            f"layers[{index}].attn_norm": (layer.attn_norm, (d,)),
            f"layers[{index}].wqkv": (layer.wqkv, (d, q + 2 * kv)),
            f"layers[{index}].wo": (layer.wo, (q, d)),
            f"layers[{index}].ffn_norm": (layer.ffn_norm, (d,)),
            f"layers[{index}].w_gate_up": (layer.w_gate_up, (d, 2 * ff)),
            f"layers[{index}].w_down": (layer.w_down, (ff, d)),
        })
        for field, (wanted, shape) in optional.items():
            array = getattr(layer, field)
            if (array is not None) != wanted:
                raise ValueError(f"layers[{index}].{field} is {'missing' if wanted else 'given'}, but this "
                                 f"layout {'needs' if wanted else 'has no'} it")
            if wanted:
                expected[f"layers[{index}].{field}"] = (array, shape)
    for name, (values, want) in expected.items():
        if tuple(values.shape) != want or values.dtype != np.float32:
            raise ValueError(f"{name} is {values.dtype}{values.shape}, expected float32{want}")

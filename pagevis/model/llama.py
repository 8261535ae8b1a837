"""The Llama forward pass, shared by the GGUF-loaded and the synthetic model.

Pre-norm decoder: x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); logits = RMSNorm(x) @ W_out.
Attention itself is the caller's `attend` (it owns the KV cache); this module only projects
Q, K, V, applies RoPE and projects the result back. All arithmetic stays float32. Products with the
weights go through matmul.py: BLAS gemm for many rows, a blocked kernel measured per shape for the few rows
of a decode step (`plan`; the default, GEMM_ONLY, is plain gemm).
"""

from __future__ import annotations

import numpy as np

from pagevis.model.config import ModelConfig
from pagevis.model.interface import AttendFn
from pagevis.model.matmul import GEMM_ONLY, MatmulPlan, matmul
from pagevis.model.rope import apply_rope, inverse_frequencies, rope_tables
from pagevis.model.tokenizer import Tokenizer
from pagevis.model.weights import LayerWeights, LlamaWeights, check_weight_shapes


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, row-wise, in float32 (eps must be np.float32)."""
    mean_square = np.add.reduce(np.square(x), axis=-1, keepdims=True)  # np.mean's sum, without its wrapper
    mean_square /= np.float32(x.shape[-1])
    mean_square += eps
    np.sqrt(mean_square, out=mean_square)
    out = np.divide(x, mean_square)
    out *= weight
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate * sigmoid(gate) * up as a new contiguous float32 array (gate and up may be strided views)."""
    out = np.negative(gate)
    np.exp(out, out=out)
    out += np.float32(1)
    np.divide(gate, out, out=out)
    out *= up
    return out


class LlamaModel:
    """A Llama-family decoder with float32 weights; implements the Model protocol."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights, tokenizer: Tokenizer | None,
                 plan: MatmulPlan = GEMM_ONLY) -> None:
        check_weight_shapes(config, weights)
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.plan = plan
        self._eps = np.float32(config.rms_eps)
        self._inv_freq = inverse_frequencies(config.head_dim, config.rope_base)

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        attend: AttendFn,
        *,
        all_logits: bool = False,
        logit_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        ids, pos = self._check_inputs(token_ids, positions)
        x = self.weights.embedding[ids].astype(np.float32, order="C")
        cos, sin = rope_tables(pos, self._inv_freq)
        for index, layer in enumerate(self.weights.layers):
            self._attention_block(index, layer, x, pos, cos, sin, attend)
            self._feed_forward_block(layer, x)
        if logit_rows is not None:  # a batch of sequences: the last row of each
            return self._logits(x[logit_rows])
        if not all_logits:
            x = x[-1:]
        logits = self._logits(x)
        return logits if all_logits else logits[0]

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return matmul(rms_norm(x, self.weights.output_norm, self._eps), self.weights.output_t, self.plan)

    def _attention_block(
        self, index: int, layer: LayerWeights, x: np.ndarray, pos: np.ndarray,
        cos: np.ndarray, sin: np.ndarray, attend: AttendFn,
    ) -> None:
        c = self.config
        n = x.shape[0]
        qkv = matmul(rms_norm(x, layer.attn_norm, self._eps), layer.wqkv, self.plan)
        q = apply_rope(qkv[:, :c.q_dim].reshape(n, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope(qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim), cos, sin)
        v = np.ascontiguousarray(qkv[:, c.q_dim + c.kv_dim:]).reshape(n, c.n_kv_heads, c.head_dim)
        out = attend(index, q, k, v, pos)
        if out.shape != q.shape:
            raise ValueError(f"attend returned shape {out.shape} for layer {index}, expected {q.shape}")
        x += matmul(np.asarray(out, dtype=np.float32).reshape(n, c.q_dim), layer.wo, self.plan)

    def _feed_forward_block(self, layer: LayerWeights, x: np.ndarray) -> None:
        d_ff = self.config.d_ff
        gate_up = matmul(rms_norm(x, layer.ffn_norm, self._eps), layer.w_gate_up, self.plan)
        hidden = silu_mul(gate_up[:, :d_ff], gate_up[:, d_ff:])
        x += matmul(hidden, layer.w_down, self.plan)

    def _check_inputs(self, token_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(token_ids).reshape(-1)
        pos = np.asarray(positions).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        if ids.shape != pos.shape:
            raise ValueError(f"{ids.size} token ids but {pos.size} positions")
        if not (np.issubdtype(ids.dtype, np.integer) and np.issubdtype(pos.dtype, np.integer)):
            raise ValueError("token ids and positions must be integers")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        if pos.min() < 0:
            raise ValueError(f"positions must be non-negative, got {pos.min()}")
        return ids.astype(np.int64, copy=False), pos.astype(np.int64, copy=False)

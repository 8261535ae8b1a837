"""The decoder forward pass, shared by every architecture (config.Layout says how each wires it) and by the
synthetic model.

Pre-norm decoder: x += Attn(RMSNorm(x)); x += FFN(RMSNorm(x)); logits = RMSNorm(x) @ W_out — Llama's. The
layout adds: a bias on Q, K, V (Qwen 2), RMSNorm per head of Q and K (Qwen 3, Gemma 3), RMSNorm of each block's
output before its residual add and GeGLU for SwiGLU (Gemma 3), a scale on the embedded tokens, RoPE on halves,
a RoPE base per layer. Attention itself is the caller's `attend` (it owns the KV cache and each layer's sliding
window, config.sliding_windows); this module only projects Q, K, V, applies RoPE and projects the result
back. All arithmetic stays float32. Products with the
weights go through matmul.py: BLAS gemm for many rows, a blocked kernel measured per shape for the few rows
of a decode step (`plan`; the default, GEMM_ONLY, is plain gemm).
"""

from __future__ import annotations

import numpy as np

from pagevis.model.config import ModelConfig
from pagevis.model.interface import AttendFn
from pagevis.model.layers import ACTIVATIONS, rms_norm, soft_cap
from pagevis.model.matmul import GEMM_ONLY, MatmulPlan, matmul
from pagevis.model.rope import apply_rope, apply_rope_neox, inverse_frequencies, rope_tables
from pagevis.model.tokenizer import Tokenizer
from pagevis.model.weights import LayerWeights, DecoderWeights, check_weight_shapes

__all__ = ["DecoderModel"]


class DecoderModel:
    """A decoder with float32 weights (every registered architecture: config.Layout says how each wires it);
    implements the Model protocol."""

    def __init__(self, config: ModelConfig, weights: DecoderWeights, tokenizer: Tokenizer | None,
                 plan: MatmulPlan = GEMM_ONLY) -> None:
        check_weight_shapes(config, weights)
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.plan = plan
        # what `run --json` and the status bar say of the weights (load_model fills it in for a GGUF file)
        self.weight_info = {"format": "float32", "types": {"F32": len(weights.matrices())},
                            "bytes": int(weights.nbytes_per_token())}
        self._eps = np.float32(config.rms_eps)
        layout = config.layout
        self._rope_keys = tuple(zip(config.rope_bases, config.rope_scales))  # per layer: (base, linear scale)
        self._inv_freqs = {key: inverse_frequencies(config.head_dim, key[0], config.rope_factors, key[1])
                           for key in set(self._rope_keys)}
        self._rope = apply_rope_neox if layout.rope_neox else apply_rope
        self._activation = ACTIVATIONS[layout.activation]
        # attend scales scores by 1/sqrt(head_dim) (DenseAttention, the paged cache): another scale is
        # folded into the queries.
        scale = 1.0 if layout.query_scale is None else layout.query_scale * np.sqrt(config.head_dim)
        self._query_scale = None if np.float32(scale) == 1 else np.float32(scale)

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
        if self.config.layout.embedding_scale != 1:
            x *= np.float32(self.config.layout.embedding_scale)
        tables = {key: rope_tables(pos, inv_freq) for key, inv_freq in self._inv_freqs.items()}
        for index, layer in enumerate(self.weights.layers):
            cos, sin = tables[self._rope_keys[index]]
            self._attention_block(index, layer, x, pos, cos, sin, attend)
            self._feed_forward_block(layer, x)
        if logit_rows is not None:  # a batch of sequences: the last row of each
            return self._logits(x[logit_rows])
        if not all_logits:
            x = x[-1:]
        logits = self._logits(x)
        return logits if all_logits else logits[0]

    def _logits(self, x: np.ndarray) -> np.ndarray:
        logits = matmul(rms_norm(x, self.weights.output_norm, self._eps), self.weights.output_t, self.plan)
        cap = self.config.layout.logit_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def _attention_block(
        self, index: int, layer: LayerWeights, x: np.ndarray, pos: np.ndarray,
        cos: np.ndarray, sin: np.ndarray, attend: AttendFn,
    ) -> None:
        c = self.config
        n = x.shape[0]
        qkv = matmul(rms_norm(x, layer.attn_norm, self._eps), layer.wqkv, self.plan)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        q = qkv[:, :c.q_dim].reshape(n, c.n_heads, c.head_dim)
        k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.n_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # qk_norm: both (check_weight_shapes)
            q, k = rms_norm(q, layer.q_norm, self._eps), rms_norm(k, layer.k_norm, self._eps)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self._query_scale is not None:
            q *= self._query_scale
        v = np.ascontiguousarray(qkv[:, c.q_dim + c.kv_dim:]).reshape(n, c.n_kv_heads, c.head_dim)
        out = attend(index, q, k, v, pos)
        if out.shape != q.shape:
            raise ValueError(f"attend returned shape {out.shape} for layer {index}, expected {q.shape}")
        projected = matmul(np.asarray(out, dtype=np.float32).reshape(n, c.q_dim), layer.wo, self.plan)
        x += projected if layer.post_attn_norm is None else rms_norm(projected, layer.post_attn_norm, self._eps)

    def _feed_forward_block(self, layer: LayerWeights, x: np.ndarray) -> None:
        d_ff = self.config.d_ff
        gate_up = matmul(rms_norm(x, layer.ffn_norm, self._eps), layer.w_gate_up, self.plan)
        hidden = self._activation(gate_up[:, :d_ff], gate_up[:, d_ff:])
        down = matmul(hidden, layer.w_down, self.plan)
        x += down if layer.post_ffn_norm is None else rms_norm(down, layer.post_ffn_norm, self._eps)

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

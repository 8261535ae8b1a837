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
from pagevis.model.layers import soft_cap
from pagevis.model.matmul import GEMM_ONLY, MatmulPlan, matmul
from pagevis.model.resident import release_compiler_pages
from pagevis.model.rope import inverse_frequencies, rope_rows
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
        self._neox = bool(layout.rope_neox)
        self._gelu = layout.activation == "gelu_tanh"
        self._vectors = _layer_vectors(weights)
        # attend scales scores by 1/sqrt(head_dim) (DenseAttention, the paged cache): another scale is
        # folded into the queries.
        scale = 1.0 if layout.query_scale is None else layout.query_scale * np.sqrt(config.head_dim)
        self._query_scale = np.float32(scale)
        if _load_fused():  # now rather than in the first forward; the linker's code pages go out again after it
            release_compiler_pages()

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
        fused = _fused()
        x = self.weights.embedding[ids].astype(np.float32, order="C")
        if self.config.layout.embedding_scale != 1:
            x *= np.float32(self.config.layout.embedding_scale)
        tables = {key: rope_rows(pos, inv_freq) for key, inv_freq in self._inv_freqs.items()}
        # h: each block's normed input, written by the residual add before it (fused_kernels.residual_norm); after
        # the last layer, RMSNorm(x) * output_norm
        h = np.empty_like(x)
        hidden = np.empty((len(x), self.config.d_ff), np.float32)
        vectors = self._vectors
        fused.residual_norm(x, NO_ROWS, NOTHING, vectors[0][0], self._eps, h)
        for index, layer in enumerate(self.weights.layers):
            cos, sin = tables[self._rope_keys[index]]
            _, post_attn, ffn_norm, post_ffn, following = vectors[index][:5]
            fused.residual_norm(x, _rows(self._attention_block(index, layer, h, pos, cos, sin, attend)), post_attn,
                                ffn_norm, self._eps, h)
            fused.gated(_rows(matmul(h, layer.w_gate_up, self.plan)), self.config.d_ff, self._gelu, hidden)
            fused.residual_norm(x, _rows(matmul(hidden, layer.w_down, self.plan)), post_ffn, following, self._eps, h)
        if logit_rows is not None:  # a batch of sequences: the last row of each
            return self._logits(h[logit_rows])
        if not all_logits:
            return self._logits(h[-1:])[0]
        return self._logits(h)

    def _logits(self, normed: np.ndarray) -> np.ndarray:
        logits = matmul(normed, self.weights.output_t, self.plan)
        cap = self.config.layout.logit_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def _attention_block(
        self, index: int, layer: LayerWeights, h: np.ndarray, pos: np.ndarray,
        cos: np.ndarray, sin: np.ndarray, attend: AttendFn,
    ) -> np.ndarray:
        """The attention block's output projection (before any post-norm and the residual add) for the normed h."""
        c = self.config
        n = h.shape[0]
        qkv = _rows(matmul(h, layer.wqkv, self.plan))
        # q, k, v: fresh arrays each layer (an attend may keep them), one allocation
        heads = np.empty(n * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, np.float32)
        q = heads[:n * c.q_dim].reshape(n, c.n_heads, c.head_dim)
        k = heads[n * c.q_dim:n * (c.q_dim + c.kv_dim)].reshape(n, c.n_kv_heads, c.head_dim)
        v = heads[n * (c.q_dim + c.kv_dim):].reshape(n, c.n_kv_heads, c.head_dim)
        _, _, _, _, _, bias, q_norm, k_norm = self._vectors[index]
        _fused().prepare_qkv(qkv, bias, q_norm, k_norm, self._eps, cos, sin, self._neox, self._query_scale, q, k, v)
        out = attend(index, q, k, v, pos)
        if out.shape != q.shape:
            raise ValueError(f"attend returned shape {out.shape} for layer {index}, expected {q.shape}")
        return matmul(np.asarray(out, dtype=np.float32).reshape(n, c.q_dim), layer.wo, self.plan)

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


NOTHING = np.empty(0, np.float32)       # an absent norm weight or bias (fused_kernels' "none")
NO_ROWS = np.empty((0, 0), np.float32)  # residual_norm's delta before the first layer: nothing to add


def _vector(values: np.ndarray | None) -> np.ndarray:
    return NOTHING if values is None else np.ascontiguousarray(values, dtype=np.float32)


def _layer_vectors(weights: DecoderWeights) -> list[tuple[np.ndarray, ...]]:
    """Per layer, as the fused kernels take them: attn_norm, post_attn_norm, ffn_norm, post_ffn_norm, the norm
    after the layer (the next layer's attn_norm, or output_norm), qkv_bias, q_norm, k_norm (NOTHING where absent)."""
    layers = weights.layers
    followers = [layer.attn_norm for layer in layers[1:]] + [weights.output_norm]
    return [tuple(_vector(v) for v in (layer.attn_norm, layer.post_attn_norm, layer.ffn_norm, layer.post_ffn_norm,
                                       following, layer.qkv_bias, layer.q_norm, layer.k_norm))
            for layer, following in zip(layers, followers, strict=True)]


def _rows(product: np.ndarray) -> np.ndarray:
    """A product's rows as the fused kernels take them: C-contiguous (a packed matrix whose outputs are not a
    multiple of its tile gives a column slice)."""
    return product if product.flags.c_contiguous else np.ascontiguousarray(product)


_FUSED = None


def _fused():
    """fused_kernels, loaded (_load_fused) by the first DecoderModel."""
    if _FUSED is None:
        _load_fused()
    return _FUSED


def _load_fused() -> bool:
    """Import fused_kernels (numba's on-disk cache, ~0.1 s; a first compile a few seconds, under the weight kernels'
    compile lock), once; whether this call loaded them. A cache numba cannot use compiles them in memory."""
    global _FUSED
    if _FUSED is not None:
        return False
    import sys

    from pagevis.model.quantized import _compiling_alone, _numba_cache_off

    with _compiling_alone() as alone:
        if alone:
            try:
                from pagevis.model import fused_kernels
                _FUSED = fused_kernels
                return True
            except Exception:  # numba's cache: a damaged file, "no locator available", ...
                sys.modules.pop("pagevis.model.fused_kernels", None)
        with _numba_cache_off():
            from pagevis.model import fused_kernels
            _FUSED = fused_kernels
    return True

"""The decoder forward pass, shared by every architecture (config.Layout says how each wires it) and by the
synthetic model.

Pre-norm decoder: x += Attn(RMSNorm(x)); x += FFN(RMSNorm(x)); logits = RMSNorm(x) @ W_out — Llama's. The
layout adds: a bias on Q, K, V (Qwen 2), RMSNorm per head of Q and K (Qwen 3, Gemma 3), RMSNorm of each block's
output before its residual add and GeGLU for SwiGLU (Gemma 3), a scale on the embedded tokens, RoPE on halves,
a RoPE base per layer. Attention itself is the caller's `attend` (it owns the KV cache and each layer's sliding
window, config.sliding_windows); this module only projects Q, K, V, applies RoPE and projects the result
back. Between the weight products a layer is four numba calls (fused_kernels.py): residual add and RMSNorm
together, Q/K bias, norm, RoPE and scale together, the gated activation; float32, sums of squares in float64.
Products with the weights go through matmul.py: BLAS gemm for many rows, a blocked kernel measured per shape for
the few rows of a decode step (`plan`; the default, GEMM_ONLY, is plain gemm).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pagevis.kernel_loader import import_kernels
from pagevis.model.config import ModelConfig
from pagevis.model.interface import AttendFn
from pagevis.model.layers import soft_cap
from pagevis.model.matmul import GEMM_ONLY, MatmulPlan, matmul
from pagevis.model.resident import release_compiler_pages
from pagevis.model.rope import inverse_frequencies, rope_rows
from pagevis.model.tokenizer import Tokenizer
from pagevis.model.weights import DecoderWeights, LayerWeights, check_weight_shapes

__all__ = ["DecoderModel"]


class _Layer(NamedTuple):
    """A layer as the forward takes it: its weights, its row of RoPE tables, and its vectors as the fused kernels
    take them (NOTHING where absent); `following` is the norm after the layer (the next attn_norm, or output_norm)."""
    weights: LayerWeights
    rope: int
    attn_norm: np.ndarray
    post_attn_norm: np.ndarray
    ffn_norm: np.ndarray
    post_ffn_norm: np.ndarray
    following: np.ndarray
    qkv_bias: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray


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
        rope_keys = tuple(zip(config.rope_bases, config.rope_scales))  # per layer: (base, linear scale)
        keys = sorted(set(rope_keys))
        # each (base, scale)'s inverse frequencies, a row each (Gemma 3: local and global layers' bases)
        self._inv_freqs = np.stack([inverse_frequencies(config.head_dim, base, config.rope_factors, scale)
                                    for base, scale in keys])
        # attend scales scores by 1/sqrt(head_dim) (DenseAttention, the paged cache): another scale is
        # folded into the queries.
        scale = 1.0 if layout.query_scale is None else layout.query_scale * np.sqrt(config.head_dim)
        c = config
        # what the fused kernels take, fixed at load: config's dims and flags (and per layer, _Layer)
        self._fixed = (c.n_heads, c.n_kv_heads, c.head_dim, c.q_dim, c.q_dim + c.kv_dim, c.d_ff, self._eps,
                       bool(layout.rope_neox), layout.activation == "gelu_tanh", np.float32(scale))
        self._layers = [_Layer(layer, keys.index(key), *vectors) for layer, key, vectors in
                        zip(weights.layers, rope_keys, _layer_vectors(weights), strict=True)]
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
        plan, eps, d_ff, gelu = self.plan, self._eps, self._fixed[5], self._fixed[8]
        x = np.asarray(self.weights.embedding[ids], dtype=np.float32, order="C")  # a fresh array: added to below
        if self.config.layout.embedding_scale != 1:
            x *= np.float32(self.config.layout.embedding_scale)
        n = len(x)
        cos = np.empty((len(self._inv_freqs), n, self._inv_freqs.shape[1]), np.float32)
        sin = np.empty_like(cos)
        if n <= FUSED_ROPE_ROWS:
            fused.rope_tables(pos, self._inv_freqs, cos, sin)
        else:  # NumPy's vectorised cos and sin
            for key, inv_freq in enumerate(self._inv_freqs):
                cos[key], sin[key] = rope_rows(pos, inv_freq)
        # h: each block's normed input, written by the residual add before it (fused_kernels.residual_norm); after
        # the last layer, RMSNorm(x) * output_norm
        h = np.empty_like(x)
        hidden = np.empty((min(n, MLP_ROWS), d_ff), np.float32)
        fused.residual_norm(x, NO_ROWS, NOTHING, self._layers[0][2], eps, h)
        for index, entry in enumerate(self._layers):
            layer, key, _, post_attn, ffn_norm, post_ffn, following, _, _, _ = entry
            projected = self._attention_block(index, entry, h, pos, cos[key], sin[key], attend)
            fused.residual_norm(x, _rows(projected), post_attn, ffn_norm, eps, h)
            del projected
            if n <= MLP_ROWS:
                fused.gated(_rows(matmul(h, layer.w_gate_up, plan)), d_ff, gelu, hidden)
                fused.residual_norm(x, _rows(matmul(hidden, layer.w_down, plan)), post_ffn, following, eps, h)
                continue
            for r0 in range(0, n, MLP_ROWS):  # a long prefill's feed-forward, MLP_ROWS rows at a time
                r1 = min(n, r0 + MLP_ROWS)
                part = hidden[:r1 - r0]
                fused.gated(_rows(matmul(h[r0:r1], layer.w_gate_up, plan)), d_ff, gelu, part)
                fused.residual_norm(x[r0:r1], _rows(matmul(part, layer.w_down, plan)), post_ffn, following, eps,
                                    h[r0:r1])
        if logit_rows is not None:  # a batch of sequences: the last row of each
            return self._logits(h[logit_rows])
        if not all_logits:
            return self._logits(h[-1:])[0]
        return self._logits(h)

    def _logits(self, normed: np.ndarray) -> np.ndarray:
        logits = matmul(normed, self.weights.output_t, self.plan)
        cap = self.config.layout.logit_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def _attention_block(self, index: int, entry: _Layer, h: np.ndarray, pos: np.ndarray, cos: np.ndarray,
                         sin: np.ndarray, attend: AttendFn) -> np.ndarray:
        """The attention block's output projection (before any post-norm and the residual add) for the normed h."""
        layer, _, _, _, _, _, _, bias, q_norm, k_norm = entry
        n_heads, n_kv, d, q_end, k_end, _, eps, neox, _, query_scale = self._fixed
        n = h.shape[0]
        qkv = _rows(matmul(h, layer.wqkv, self.plan))
        # q, k, v: fresh arrays each layer (an attend may keep them), one allocation
        heads = np.empty((n, n_heads + 2 * n_kv, d), np.float32)
        q, k, v = heads[:, :n_heads], heads[:, n_heads:n_heads + n_kv], heads[:, n_heads + n_kv:]
        if n > 1:  # each its own block (a decode row's are already)
            flat = heads.reshape(-1)
            q = flat[:n * q_end].reshape(n, n_heads, d)
            k = flat[n * q_end:n * k_end].reshape(n, n_kv, d)
            v = flat[n * k_end:].reshape(n, n_kv, d)
        _fused().prepare_qkv(qkv, bias, q_norm, k_norm, eps, cos, sin, neox, query_scale, q, k, v)
        del qkv  # (a long prefill's projections: not held through its attention, 25 MB for Gemma 3 at 4,096 tokens)
        out = attend(index, q, k, v, pos)
        if out.shape != q.shape:
            raise ValueError(f"attend returned shape {out.shape} for layer {index}, expected {q.shape}")
        return matmul(np.asarray(out, dtype=np.float32).reshape(n, q_end), layer.wo, self.plan)

    def _check_inputs(self, token_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(token_ids).reshape(-1)
        pos = np.asarray(positions).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        if ids.shape != pos.shape:
            raise ValueError(f"{ids.size} token ids but {pos.size} positions")
        if ids.dtype.kind not in "iu" or pos.dtype.kind not in "iu":
            raise ValueError("token ids and positions must be integers")
        low, high, first = (int(ids[0]),) * 2 + (int(pos[0]),) if ids.size == 1 else (ids.min(), ids.max(), pos.min())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {low}..{high}")
        if first < 0:
            raise ValueError(f"positions must be non-negative, got {first}")
        return ids.astype(np.int64, copy=False), np.ascontiguousarray(pos, dtype=np.int64)


# A prefill's feed-forward goes this many rows at a time (its gate/up product and activation are (rows, 2 d_ff) and
# (rows, d_ff) float32: 75 MB for SmolLM2's 4,096-token prompt at once, 14 MB in blocks): every row's arithmetic is
# the same in any block (the packed kernels take 64 rows at a time, BLAS's tiles of 16-64 rows divide it), so no bit moves
MLP_ROWS = 768
FUSED_ROPE_ROWS = 16  # rows whose RoPE tables one numba call forms (its cos and sin are scalar calls): decoding's
NOTHING = np.empty(0, np.float32)       # an absent norm weight or bias (fused_kernels' "none")
NO_ROWS = np.empty((0, 0), np.float32)  # residual_norm's delta before the first layer: nothing to add


def _vector(values: np.ndarray | None) -> np.ndarray:
    """A weight vector as the kernels' signatures take it: float32, C-contiguous, writeable (a read-only map of the
    weight cache is copied: a few KiB)."""
    if values is None:
        return NOTHING
    vector = np.ascontiguousarray(values, dtype=np.float32)
    return vector if vector.flags.writeable else vector.copy()


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
    """Import fused_kernels (numba's cache, ~0.1 s; a first compile a few seconds; kernel_loader.import_kernels: under
    the compile lock, a damaged cache healed), once; whether this call loaded them."""
    global _FUSED
    if _FUSED is not None:
        return False
    _FUSED = import_kernels("pagevis.model.fused_kernels", "the fused layer kernels")
    return True

"""Rotary position embedding (RoPE) in llama.cpp's two pairings.

llama.cpp assigns each architecture a RoPE type: LLAMA_ROPE_TYPE_NORM (llama) rotates adjacent pairs, as
below; LLAMA_ROPE_TYPE_NEOX (qwen2, qwen3, gemma3) rotates x[i] with x[i + head_dim/2], Hugging Face's
"rotate half", and their converters leave Q and K unpermuted (apply_rope_neox).

The adjacent (llama) pairing:
Hugging Face Llama rotates x[i] with x[i + head_dim/2] ("rotate half"). llama.cpp's converter
permutes the rows of the Q and K projections so that the same pairs sit next to each other: in a
GGUF file, pair i of a head is (x[2i], x[2i+1]), rotated by angle position * base**(-2i/head_dim).
We keep the GGUF order and rotate adjacent pairs; no un-permuting is needed because attention only
uses dot products q.k, which do not change when q and k share the same permutation of dimensions.
(The keys handed to the caller's cache are therefore in GGUF dimension order.)
"""

from __future__ import annotations

import numpy as np


def inverse_frequencies(head_dim: int, base: float, factors: tuple[float, ...] = (), scale: float = 1.0) -> np.ndarray:
    """base**(-2i/head_dim) for each pair i, float64; divided by factors[i] when given (llama.cpp's
    rope_freqs tensor, how a GGUF carries Llama 3's rope scaling) and by scale (linear scaling: position p turns
    as p / scale would; rope_scaling.py)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(factors):
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    return inv_freq / scale if scale != 1 else inv_freq


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, float32 of shape (n, 1, head_dim / 2)."""
    cos, sin = rope_rows(positions, inv_freq)
    return cos[:, None, :], sin[:, None, :]


def rope_rows(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, float32 C-contiguous of shape (n, head_dim / 2) (fused_kernels').

    Angles are formed in float64 so that large positions do not lose precision before the cast.
    """
    angles = np.multiply.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each adjacent pair (x[..., 2i], x[..., 2i+1]) of x (n, heads, head_dim); new array."""
    n, heads, head_dim = x.shape
    pairs = x.reshape(n, heads, head_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = np.empty((n, heads, head_dim // 2, 2), dtype=np.float32)
    out_even, out_odd = out[..., 0], out[..., 1]
    np.multiply(even, cos, out=out_even)
    out_even -= odd * sin
    np.multiply(even, sin, out=out_odd)
    out_odd += odd * cos
    return out.reshape(n, heads, head_dim)


def apply_rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each pair (x[..., i], x[..., i + head_dim/2]) of x (n, heads, head_dim); new array."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    out = np.empty(x.shape, dtype=np.float32)
    np.multiply(first, cos, out=out[..., :half])
    out[..., :half] -= second * sin
    np.multiply(second, cos, out=out[..., half:])
    out[..., half:] += first * sin
    return out

"""Rotary position embedding (RoPE) in the GGUF layout: rotation of ADJACENT pairs.

Hugging Face Llama rotates x[i] with x[i + head_dim/2] ("rotate half"). llama.cpp's converter
permutes the rows of the Q and K projections so that the same pairs sit next to each other: in a
GGUF file, pair i of a head is (x[2i], x[2i+1]), rotated by angle position * base**(-2i/head_dim).
We keep the GGUF order and rotate adjacent pairs; no un-permuting is needed because attention only
uses dot products q.k, which do not change when q and k share the same permutation of dimensions.
(The keys handed to the caller's cache are therefore in GGUF dimension order.)
"""

from __future__ import annotations

import numpy as np


def inverse_frequencies(head_dim: int, base: float) -> np.ndarray:
    """base**(-2i/head_dim) for each pair i, float64."""
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, float32 of shape (n, 1, head_dim / 2).

    Angles are formed in float64 so that large positions do not lose precision before the cast.
    """
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]


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

"""RoPE rotations by a position delta, on keys already rotated (adjacent pairs, as pagevis.model.rope applies
RoPE; the cache does not import the model): rotating a key made at position p by delta gives the key the
model would have made at p + delta, since RoPE's rotations compose by adding angles."""

from __future__ import annotations

import numpy as np


def inverse_frequencies(head_dim: int, base: float) -> np.ndarray:
    """base**(-2i/head_dim) for each pair i, float64 (the model's RoPE frequencies)."""
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rotate(x: np.ndarray, deltas: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x (..., d) rotated by RoPE's angles for `deltas` (x.shape[:-1], or broadcasting to it) positions;
    float64. Negative deltas undo a rotation."""
    angles = np.asarray(deltas, dtype=np.float64)[..., None] * inv_freq
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty(np.broadcast_shapes(x.shape, (*angles.shape[:-1], x.shape[-1])), dtype=np.float64)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out

"""The layer kit in NumPy: RMSNorm and the gated feed-forward activations, in float32. The decoder runs their fused
numba form (fused_kernels.py: one call for many of these steps, at decode a row's ufunc calls cost more than their
arithmetic); these stay as the plain statement of each, which tests and tools use.

Gemma's RMSNorm multiplies by (1 + weight); llama.cpp's converter stores that (1 + weight) in the GGUF file,
so every architecture read from GGUF uses the plain form here (see docs/model.md).
"""

from __future__ import annotations

import numpy as np

GELU_C = np.float32(np.sqrt(2 / np.pi))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32 (eps must be np.float32).
    Works on rows (n, d) and on heads (n, heads, head_dim) alike."""
    mean_square = np.add.reduce(np.square(x), axis=-1, keepdims=True)  # np.mean's sum, without its wrapper
    mean_square /= np.float32(x.shape[-1])
    mean_square += eps
    np.sqrt(mean_square, out=mean_square)
    out = np.divide(x, mean_square)
    out *= weight
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU: gate * sigmoid(gate) * up as a new contiguous float32 array (gate and up may be strided views)."""
    out = np.negative(gate)
    np.exp(out, out=out)
    out += np.float32(1)
    np.divide(gate, out, out=out)
    out *= up
    return out


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GeGLU with the tanh GELU (PyTorch's gelu(approximate="tanh")): 0.5 g (1 + tanh(c (g + 0.044715 g^3))) up."""
    inner = np.square(gate)
    inner *= np.float32(0.044715)
    inner += np.float32(1)
    inner *= gate
    inner *= GELU_C
    np.tanh(inner, out=inner)
    inner += np.float32(1)
    inner *= gate
    inner *= np.float32(0.5)
    inner *= up
    return inner


ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


def soft_cap(logits: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(logits / cap), in place."""
    logits /= np.float32(cap)
    np.tanh(logits, out=logits)
    logits *= np.float32(cap)
    return logits

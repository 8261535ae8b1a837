"""The shape of a decoder model (Llama, Qwen 2/3, Gemma 3), independent of where its weights came from."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pagevis.errors import check_int
from pagevis.model.errors import ModelConfigError

# Upper bounds on a model's shape: far above any model pagevis can run in memory, low enough that a bad
# file or flag is refused before the loader builds per-layer tables or allocates weights.
LIMITS = {"n_layers": 1024, "d_model": 1 << 16, "n_heads": 1024, "n_kv_heads": 1024, "head_dim": 1024,
          "d_ff": 1 << 18, "vocab_size": 1 << 21, "context_length": 2**31 - 1}


def check_positive_int(field: str, value: Any) -> int:
    """Return value as an int if it is a positive integer (within LIMITS), else raise ModelConfigError naming it."""
    high = LIMITS.get(field, 2**31 - 1)
    return check_int(field, value, 1, high, "a positive integer" if high == 2**31 - 1 else f"a positive integer up to {high}")


ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Layout:
    """How an architecture wires the common pre-norm decoder block (the defaults are Llama's).

    rope_neox: rotate halves (x[i], x[i + d/2]) instead of adjacent pairs (see rope.py). qkv_bias: Q, K, V
    projections add a bias (Qwen 2). qk_norm: RMSNorm over each head of Q and K before RoPE (Qwen 3, Gemma 3).
    post_norms: RMSNorm of the attention and feed-forward outputs before each residual add (Gemma 3).
    activation: the gated feed-forward's gate, "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh GELU).
    embedding_scale multiplies the embedded tokens (Gemma: sqrt(d_model)). query_scale: the attention score
    scale (None: 1/sqrt(head_dim)). logit_softcap: logits = cap * tanh(logits / cap) when set.
    """

    rope_neox: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embedding_scale: float = 1.0
    query_scale: float | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ModelConfigError("activation", self.activation, f"one of {', '.join(ACTIVATIONS)}")
        for name in ("embedding_scale", "query_scale", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:  # NaN and inf are not scales
                raise ModelConfigError(name, value, "a positive finite number")


LLAMA_LAYOUT = Layout()


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder.

    n_heads query heads share n_kv_heads key/value heads (grouped-query attention; n_kv_heads == 1
    is multi-query). rope_base is the file's RoPE frequency base; rms_eps the RMSNorm epsilon.
    context_length is the trained context; positions beyond it still work (RoPE extrapolates,
    with degraded quality).

    Per layer (one entry each; left empty they are filled in): rope_bases, the RoPE base of each layer (Gemma 3's
    local layers use 10 000, its global ones rope_base), and sliding_windows, how many of the latest positions
    a query of that layer sees (itself included), None for a full (global) layer. rope_factors divides each
    RoPE frequency (llama.cpp's rope_freqs: Llama 3's rope scaling), empty for none. rope_scale divides every
    RoPE position (linear scaling, llama.cpp's rope.scaling.factor; 1.0: none) and rope_scales is it per layer
    (Gemma 3's local layers are never scaled).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    context_length: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    architecture: str = "llama"
    layout: Layout = LLAMA_LAYOUT
    rope_bases: tuple[float, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()
    rope_factors: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    rope_scale: float = 1.0
    rope_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                      "vocab_size", "context_length"):
            check_positive_int(field, getattr(self, field))
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                "n_heads", self.n_heads, f"a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError("head_dim", self.head_dim, "even (RoPE rotates pairs)")
        if not 1 < self.rope_base < math.inf:  # an infinite base passed `> 1`: every angle 0
            raise ModelConfigError("rope_base", self.rope_base, "a finite number greater than 1")
        if not 0 < self.rms_eps < math.inf:
            raise ModelConfigError("rms_eps", self.rms_eps, "a positive finite number")
        for token in (*self.eos_ids, *(() if self.bos_id is None else (self.bos_id,))):
            if not 0 <= token < self.vocab_size:
                raise ModelConfigError("eos_ids/bos_id", token, f"a token id below {self.vocab_size}")
        self._fill_per_layer()

    def _fill_per_layer(self) -> None:
        bases = tuple(float(b) for b in self.rope_bases) or (float(self.rope_base),) * self.n_layers
        windows = tuple(self.sliding_windows) or (None,) * self.n_layers
        scales = tuple(float(s) for s in self.rope_scales) or (float(self.rope_scale),) * self.n_layers
        for name, values in (("rope_bases", bases), ("sliding_windows", windows), ("rope_scales", scales)):
            if len(values) != self.n_layers:
                raise ModelConfigError(name, len(values), f"one entry per layer ({self.n_layers})")
        if not all(1 < b < math.inf for b in bases):
            raise ModelConfigError("rope_bases", next(b for b in bases if not 1 < b < math.inf),
                                   "finite numbers greater than 1")
        bad_scale = next((s for s in (self.rope_scale, *scales) if not 0 < s < math.inf), None)
        if bad_scale is not None:
            raise ModelConfigError("rope_scales", bad_scale, "positive finite numbers")
        for window in windows:
            if window is not None:
                check_positive_int("sliding_window", window)
        if self.rope_factors and (len(self.rope_factors) != self.head_dim // 2
                                  or not all(0 < f < math.inf for f in self.rope_factors)):
            raise ModelConfigError("rope_factors", len(self.rope_factors),
                                   f"{self.head_dim // 2} positive numbers (one per RoPE pair)")
        object.__setattr__(self, "rope_bases", bases)  # frozen: filled once, here
        object.__setattr__(self, "sliding_windows", windows)
        object.__setattr__(self, "rope_scales", scales)

    @property
    def rope_scaled(self) -> bool:
        """True when some layer's RoPE angles are not plain position * base**(-2i/d) (a linear scale or rope_freqs):
        whoever redoes RoPE outside the model (the cache's re-rotation) must then refuse or follow."""
        return bool(self.rope_factors) or any(s != 1 for s in self.rope_scales)

    @property
    def local_windows(self) -> tuple[int | None, ...] | None:
        """sliding_windows when some layer keeps a window (a hybrid or all-local cache), else None."""
        return self.sliding_windows if any(w is not None for w in self.sliding_windows) else None

    def weight_bytes(self) -> int:
        """The float32 weights this shape needs (embedding and output tied, as the smallest case)."""
        d, ff = self.d_model, self.d_ff
        per_layer = 2 * d + d * self.q_dim * 2 + 2 * d * self.kv_dim + 3 * d * ff
        return 4 * (self.vocab_size * d + d + self.n_layers * per_layer)

    @property
    def q_dim(self) -> int:
        """Width of all query heads together."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together."""
        return self.n_kv_heads * self.head_dim

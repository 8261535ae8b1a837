"""The shape of a Llama-family model, independent of where its weights came from."""

from __future__ import annotations

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


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    n_heads query heads share n_kv_heads key/value heads (grouped-query attention; n_kv_heads == 1
    is multi-query). rope_base is the RoPE frequency base; rms_eps the RMSNorm epsilon.
    context_length is the trained context; positions beyond it still work (RoPE extrapolates,
    with degraded quality).
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
        if not self.rope_base > 1:
            raise ModelConfigError("rope_base", self.rope_base, "a number greater than 1")
        if not self.rms_eps > 0:
            raise ModelConfigError("rms_eps", self.rms_eps, "a positive number")
        for token in (*self.eos_ids, *(() if self.bos_id is None else (self.bos_id,))):
            if not 0 <= token < self.vocab_size:
                raise ModelConfigError("eos_ids/bos_id", token, f"a token id below {self.vocab_size}")

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

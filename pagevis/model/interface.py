"""What the rest of pagevis codes against: a model that leaves attention to its caller."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from pagevis.model.config import ModelConfig
from pagevis.model.tokenizer import Tokenizer

# attend(layer, q, k, v, positions) -> out
#   q: (n, n_heads, head_dim) float32, RoPE already applied
#   k, v: (n, n_kv_heads, head_dim) float32, RoPE already applied to k
#   positions: (n,) int64 absolute positions of the n new tokens
#   returns out: (n, n_heads, head_dim) float32 (attention output before the o-projection)
# The callee owns the KV cache: it stores k and v, and attends each query over whatever it keeps.
AttendFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Model(Protocol):
    config: ModelConfig
    # The synthetic model has a ByteTokenizer (one token per byte); a GGUF without tokenizer
    # metadata loads with None.
    tokenizer: Tokenizer | None

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        attend: AttendFn,
        *,
        all_logits: bool = False,
        logit_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run n tokens through all layers; return logits float32 of shape (vocab,) for the last
        token, or (n, vocab) when all_logits, or (len(logit_rows), vocab) for the given rows (a batch of
        sequences wants each one's last row)."""
        ...

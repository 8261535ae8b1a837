"""gemma3: Gemma 3 (text). As llama.cpp builds it (src/llama-model.cpp, LLM_ARCH_GEMMA3):

- Q/K RMSNorm per head, NEOX RoPE, GeGLU (tanh GELU), RMSNorm on each block's output before the residual add,
  embeddings times sqrt(d_model), tied output, no final logit soft-capping.
- Sliding-window pattern 6: layer i is local when i % 6 < 5, so every 6th layer (5, 11, 17, ...) is global.
  Local layers see the latest `attention.sliding_window` positions and use RoPE base 10 000; global layers see
  everything and use the file's base (1 000 000). Only global layers take the file's linear RoPE scaling
  (the 4B, 12B and 27B have factor 8; llama.cpp: rope_freq_scale_train_swa = 1).
- Scores scale by 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), except the 27B (62 layers), which uses
  1/sqrt(d_model / n_heads).
"""

from __future__ import annotations

import math
from typing import Any

from pagevis.model.architectures.base import Architecture, MetadataValue
from pagevis.model.config import Layout

SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10_000.0
LAYERS_27B = 62


def is_local(layer: int) -> bool:
    return layer % SWA_PATTERN < SWA_PATTERN - 1


def settings(value: MetadataValue, shape: dict[str, Any]) -> dict[str, Any]:
    window = value("attention.sliding_window")
    n_layers = shape["n_layers"]
    query_dim = shape["d_model"] / shape["n_heads"] if n_layers == LAYERS_27B else shape["head_dim"]
    layout = Layout(rope_neox=True, qk_norm=True, post_norms=True, activation="gelu_tanh",
                    embedding_scale=math.sqrt(shape["d_model"]), query_scale=1 / math.sqrt(query_dim))
    return {
        "layout": layout,
        "sliding_windows": tuple(window if is_local(i) else None for i in range(n_layers)),
        "rope_bases": tuple(LOCAL_ROPE_BASE if is_local(i) else shape["rope_base"] for i in range(n_layers)),
        "rope_scales": tuple(1.0 if is_local(i) else shape["rope_scale"] for i in range(n_layers)),
    }


ARCHITECTURE = Architecture("gemma3", "Gemma 3", settings)

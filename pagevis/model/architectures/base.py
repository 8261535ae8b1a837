"""What an architecture file holds: an `Architecture` (its GGUF name, the models it covers, how its metadata
reads into ModelConfig fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# value(key, kind="int", default=...) reads "<arch>.<key>" from the metadata, checked (gguf_loader.metadata_value).
MetadataValue = Callable[..., Any]


@dataclass(frozen=True)
class Architecture:
    name: str
    models: str
    # (value, shape) -> extra ModelConfig fields; shape holds n_layers, d_model, n_heads, head_dim, rope_base,
    # rope_scale.
    settings: Callable[[MetadataValue, dict[str, Any]], dict[str, Any]]

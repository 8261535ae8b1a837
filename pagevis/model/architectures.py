"""The registry of architectures pagevis runs: a GGUF's `general.architecture` -> how its config reads.

Each architecture is one small file (arch_*.py) holding an `Architecture`: its name, the models it covers (for
messages) and `settings`, which turns the file's metadata into the ModelConfig fields that differ from Llama's
(the layout, per-layer RoPE bases and sliding windows). Which tensors a layer has follows from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pagevis.model.errors import ModelLoadError

# value(key, kind="int", default=...) reads "<arch>.<key>" from the metadata, checked (gguf_loader.metadata_value).
MetadataValue = Callable[..., Any]


@dataclass(frozen=True)
class Architecture:
    name: str
    models: str
    # (value, shape) -> extra ModelConfig fields; shape holds n_layers, d_model, n_heads, head_dim, rope_base.
    settings: Callable[[MetadataValue, dict[str, Any]], dict[str, Any]]


def registry() -> dict[str, Architecture]:
    from pagevis.model import arch_gemma3, arch_llama, arch_qwen2, arch_qwen3

    return {arch.ARCHITECTURE.name: arch.ARCHITECTURE for arch in (arch_llama, arch_qwen2, arch_qwen3, arch_gemma3)}


def architecture_of(path: Path, name: str) -> Architecture:
    """The registered architecture called name, or ModelLoadError naming it and what is supported."""
    known = registry()
    if name not in known:
        supported = "; ".join(f"{arch.name!r} ({arch.models})" for arch in known.values())
        raise ModelLoadError(f"{path}: architecture {name!r} is not supported; pagevis runs {supported}")
    return known[name]

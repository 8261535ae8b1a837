"""The registry of architectures pagevis runs: a GGUF's `general.architecture` -> how its config reads.

Each architecture is one small file of this package holding an `Architecture` (base.py): its name, the models
it covers (for messages) and `settings`, which turns the file's metadata into the ModelConfig fields that differ
from Llama's (the layout, per-layer RoPE bases and sliding windows). Which tensors a layer has follows from the
layout. A new one: its file, and its module in registry()'s tuple.
"""

from __future__ import annotations

from pathlib import Path

from pagevis.model.architectures import gemma3, llama, qwen2, qwen3
from pagevis.model.architectures.base import Architecture
from pagevis.model.errors import ModelLoadError

def registry() -> dict[str, Architecture]:
    return {arch.ARCHITECTURE.name: arch.ARCHITECTURE for arch in (llama, qwen2, qwen3, gemma3)}


def architecture_of(path: Path, name: str) -> Architecture:
    """The registered architecture called name, or ModelLoadError naming it and what is supported."""
    known = registry()
    if name not in known:
        supported = "; ".join(f"{arch.name!r} ({arch.models})" for arch in known.values())
        raise ModelLoadError(f"{path}: architecture {name!r} is not supported; pagevis runs {supported}")
    return known[name]

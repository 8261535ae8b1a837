"""Which model a session runs: the shipped SmolLM2, any Llama-family GGUF file, or a synthetic model."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pagevis.kvcache import ConfigError

MODEL_KINDS = ("smollm2", "gguf", "synthetic")


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "smollm2"
    path: str | None = None  # for kind "gguf"
    # the synthetic model's layout (seeded random weights of the same architecture)
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    seed: int = 0
    sliding_window: int = 0  # > 0: local layers keep this many positions (a hybrid cache, as Gemma 3's)
    global_every: int = 0  # with a window: every this-many-th layer is global (0: every layer local)

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ConfigError("model", self.kind, f"one of {', '.join(MODEL_KINDS)}")
        if self.kind == "gguf" and not self.path:
            raise ConfigError("model path", self.path, "the path of a .gguf file")

    @property
    def label(self) -> str:
        if self.kind == "gguf":
            return str(self.path)
        if self.kind == "synthetic":
            pattern = f" W={self.sliding_window}/{self.global_every or '-'}" if self.sliding_window else ""
            return (f"synthetic {self.n_layers}L {self.n_heads}q/{self.n_kv_heads}kv "
                    f"d{self.head_dim} seed {self.seed}{pattern}")
        return "SmolLM2-135M-Instruct"

    @property
    def sliding_windows(self) -> tuple[int | None, ...] | None:
        """The synthetic model's window per layer (None: no window, or another kind: its model config says)."""
        if self.kind != "synthetic":
            return None
        from pagevis.model.synthetic import window_pattern

        return window_pattern(self.n_layers, self.sliding_window, self.global_every)

    def load(self):
        """The model, loaded once per spec and weight format (`--weights`), then shared (weights are read-only)."""
        from pagevis.model.quant_weights import weight_format

        return _load(self, weight_format())


@functools.lru_cache(maxsize=2)
def _load(spec: ModelSpec, weights: str = "quantized"):
    if spec.kind == "synthetic":
        from pagevis.model.synthetic import SyntheticModel

        return SyntheticModel(n_layers=spec.n_layers, n_heads=spec.n_heads,
                              n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, seed=spec.seed,
                              sliding_window=spec.sliding_window, global_every=spec.global_every)
    from pagevis.model import load_model

    return load_model(spec.path if spec.kind == "gguf" else None, weights=weights)

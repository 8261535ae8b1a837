"""Next-token sampling: greedy, or temperature with optional top-k and top-p, from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagevis import settings
from pagevis.settings import SAMPLING_MODES, field_for

__all__ = ["SAMPLING_MODES", "Sampler", "SamplingConfig", "log_softmax"]


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; defaults, bounds and help in the settings table (pagevis/settings.py)."""

    mode: str = field_for("mode")  # greedy or sample
    temperature: float = field_for("temperature")
    top_k: int = field_for("top_k")  # 0 = no top-k cut
    top_p: float = field_for("top_p")  # 1 = no nucleus cut
    seed: int = field_for("seed")

    def __post_init__(self) -> None:
        settings.check(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities (the oracle compares them, so precision matters more than speed)."""
    shifted = logits.astype(np.float64) - np.max(logits)
    return shifted - np.log(np.exp(shifted).sum())


class Sampler:
    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def sample_probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution `sample` draws from (after temperature, top-k and top-p)."""
        c = self.config
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scaled = logits / c.temperature
            if not np.isfinite(scaled).all():  # a tiny temperature overflows: shift first (softmax is shift-invariant)
                scaled = (logits.astype(np.float64) - np.max(logits)) / c.temperature
        probs = np.exp(log_softmax(scaled))
        if c.top_k and c.top_k < probs.size:
            cut = np.partition(probs, -c.top_k)[-c.top_k]
            probs = np.where(probs >= cut, probs, 0.0)
        if c.top_p < 1.0:
            order = np.argsort(probs)[::-1]
            cumulative = np.cumsum(probs[order]) / probs.sum()
            keep = order[: int(np.searchsorted(cumulative, c.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept
        return probs / probs.sum()

    def sample(self, logits: np.ndarray) -> int:
        if self.config.mode == "greedy":
            return int(np.argmax(logits))
        probs = self.sample_probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))

from dataclasses import dataclass

from .base import EvictionPolicy


@dataclass
class Tova(EvictionPolicy):
    """Evict the token with the lowest attention at the latest step (mean over heads)."""

    uses_attention = True
    name = "tova"
    citation = "TOVA: Oren et al. 2024, Transformers are Multi-State RNNs, arXiv:2401.06104."
    reason = "lowest attention at the latest step"

    def score(self, pages):
        return pages.last

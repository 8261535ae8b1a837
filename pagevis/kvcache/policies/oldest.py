from dataclasses import dataclass

from pagevis.kvcache.policies.base import EvictionPolicy


@dataclass
class Oldest(EvictionPolicy):
    """At capacity, evict the oldest resident token; the new token takes its slot (a token-level
    sliding window)."""

    name = "oldest"
    citation = "Token-level sliding window, the baseline in Xiao et al. 2023, arXiv:2309.17453."
    reason = "oldest resident token"

    def score(self, pages):
        return pages.positions.astype(float)

from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policies.base import EvictionPolicy


@dataclass
class RandomEviction(EvictionPolicy):
    """Evict a uniformly random resident token; seeded, so a run replays identically."""

    seed: int = 0
    name = "random"
    citation = "Random eviction: the baseline of H2O (Zhang et al. 2023, arXiv:2306.14048)."
    reason = "random draw"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.seed = self.check_int_param("seed", self.seed, 0, 2**32 - 1)
        self.reset()

    def reset(self):
        self.rng = np.random.default_rng(self.seed)

    def score(self, pages):
        return np.zeros(pages.positions.shape)  # no token is preferred; the draw decides

    def choose_victims(self, pages):
        victim = self.rng.choice(np.flatnonzero(pages.occupied()))
        return np.array([victim]), np.zeros(1)

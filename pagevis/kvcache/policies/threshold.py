from dataclasses import dataclass

import numpy as np

from pagevis.kvcache.policies.base import EvictionPolicy, newest
from pagevis.kvcache.policies.snapkv import ObservationWindow


@dataclass
class Threshold(EvictionPolicy):
    """Evict by a score threshold instead of a budget: before each token is written, every token older than
    the `window` newest whose attention from the window's queries (mean over those queries and all heads) is
    below `threshold_pct` percent of an even share (1 / the resident tokens) goes, so the cache holds as many
    tokens as attention keeps above the threshold and its size floats with the text. The capacity stays a
    ceiling: a full cache evicts its lowest score, as every policy does. DMS decides once, when a token leaves
    the window, with a trained evictor; here the window's attention decides, at every step."""

    threshold_pct: int = 10
    window: int = 16
    uses_attention = True
    prunes = True
    name = "threshold"
    citation = ("DMS: Łańcucki et al. 2025, Inference-Time Hyper-Scaling with KV Cache Compression, arXiv:2506.05345, "
                "as kvpress's DMSPress (a scorer's threshold outside a protected sliding window; no trained evictor).")
    reason = "attention below the threshold"

    def bind(self, capacity, page_size):
        super().bind(capacity, page_size)
        self.window = self.check_int_param("window", self.window, 1, capacity - 1)
        self.threshold_pct = self.check_int_param("threshold_pct", self.threshold_pct, 0, 10_000)

    def make_state(self, n_slots):
        return ObservationWindow(n_slots, self.window)

    def score(self, pages):
        """Each token's mean attention per query of the window (over heads)."""
        return pages.stats.window_attention() / max(1, min(self.window, pages.stats.next))

    def protected(self, pages):
        return newest(pages, self.window)

    def prune_room(self, pages):
        """Once a query was seen any write may prune: one token at a time, so that each is judged by the
        attention of the queries before it (a prefill chunk's queries come only after all its writes)."""
        return 1 if pages.stats.next else self.capacity

    def choose_pruned(self, pages):
        occupied = pages.occupied()
        if not pages.stats.next:  # no query yet: nothing to judge by
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        scores = self.score(pages)
        share = 1 / occupied.sum()
        below = np.flatnonzero(occupied & ~self.protected(pages) & (scores < self.threshold_pct / 100 * share))
        return below, scores[below]

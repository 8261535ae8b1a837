"""`optimal`: the clairvoyant eviction yardstick of `pagevis compare` (never offered for live decoding).

At each eviction, in each layer, it evicts the resident token that the *full* cache's queries attend to
least over the rest of the text: token j's score at step t is sum over queries p >= t of A_full[layer, p, j]
(head-mean attention, as the other score-based policies see it). It is Belady's MIN rule (evict what is
needed least in the future) with "attention mass still to come" in place of "next use".

What it optimises, exactly: each single eviction loses the least full-cache attention over the rest of the
text that any choice at that moment could lose. It is a greedy clairvoyant rule, not a proven optimum:
eviction is permanent, so the choice that loses least now is not always the best sequence of choices; it
scores with the full cache's attention, not with the bounded run's own; and perplexity is not a function of
lost attention alone. It is a fair *upper yardstick* because it sees exactly the signal every attention-score
policy (H2O, TOVA, SnapKV, ...) estimates from the past — the attention a token will receive — but from the
future, which no online policy can know. A policy near it has little left to gain by scoring attention better.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagevis.kvcache import EvictionPolicy

OPTIMAL = "optimal"


@dataclass
class FutureAttention(EvictionPolicy):
    """future[layer, position]: full-cache attention still to come on that position. Start from the total
    over all queries; `consume` each query's attention rows (layers, p + 1) once that query has run."""

    future: np.ndarray = field(default_factory=lambda: np.zeros((1, 0)))
    name = OPTIMAL
    citation = ("Belady 1966, A study of replacement algorithms for a virtual-storage computer (MIN), with the "
                "full cache's future attention as the demand; compare only.")
    reason = "least future attention (full cache)"

    def consume(self, attention: np.ndarray) -> None:
        self.future[:, : attention.shape[1]] -= attention

    def score(self, pages):
        return self.future[pages.layer, np.maximum(pages.positions, 0)]

"""The Weights view's data, Qt-free: the last query's attention over the tokens one layer holds, binned by
log10(weight), with its entropy and (with the oracle) the attention the full cache put on evicted tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagevis.engine import StepRecord

LOW_DECADE = -6  # the lowest bin's lower edge: weights below 1e-6 share the first bin
BINS_PER_DECADE = 4
EDGES = np.linspace(LOW_DECADE, 0, -LOW_DECADE * BINS_PER_DECADE + 1)  # log10 of the bin edges; 1 is the last


@dataclass(frozen=True)
class WeightHistogram:
    """The last query's attention over the tokens one layer holds, binned by log10(weight)."""

    counts: np.ndarray  # (bins,) tokens per bin (EDGES; the first bin also holds weights below 1e-6)
    mass: np.ndarray  # (bins,) the attention those tokens got, summed
    tokens: int  # tokens with a weight above 0
    zeros: int  # resident tokens with weight exactly 0: not attended by this head (dropped), or below float16
    entropy: float  # nats, of the weights (they sum to 1)
    max_weight: float
    lost: float | None  # with the oracle: the full cache's attention on the tokens this cache evicted


def weight_histogram(record: StepRecord, layer: int, head: int | None) -> WeightHistogram | None:
    """The histogram of `layer`'s attention in `record` for `head` (None: the mean over heads), or None if the
    record does not hold that layer's attention."""
    if layer not in record.attention_layers:
        return None
    index = record.attention_layers.index(layer)
    resident = record.page_map(layer).ravel() >= 0
    weights = record.attention[index][:, resident].astype(np.float64)
    weights = weights.mean(axis=0) if head is None else weights[head]
    positive = weights[weights > 0]
    bins = np.clip(np.floor((np.log10(positive) - LOW_DECADE) * BINS_PER_DECADE).astype(np.int64), 0, len(EDGES) - 2)
    counts = np.bincount(bins, minlength=len(EDGES) - 1)
    mass = np.bincount(bins, weights=positive, minlength=len(EDGES) - 1)
    share = positive / positive.sum() if positive.size else positive
    lost = None
    by_head = record.oracle.lost_by_head if record.oracle is not None else None
    if by_head is not None:
        row = np.asarray(by_head[index], dtype=np.float64)
        lost = float(row.mean() if head is None else row[head])
    return WeightHistogram(counts=counts, mass=mass, tokens=int(positive.size), zeros=int((weights == 0).sum()),
                           entropy=float(-(share * np.log(share)).sum()),
                           max_weight=float(positive.max()) if positive.size else 0.0, lost=lost)

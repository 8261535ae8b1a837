"""What many-sequence decoding is configured with, and what each engine step records.

The engine itself (scheduler, batched forward, sampling) is pagevis.decoding.engine.Engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..engine import CacheEvent
from ..errors import check_int

MAX_SEQUENCES = 256
MAX_CHUNK = 512  # prompt tokens one sequence feeds per step (bounds a step's activations)


@dataclass(frozen=True)
class BatchConfig:
    pool_pages: int | None = None  # page ids per layer; None: enough for max_seqs sequences without sharing
    max_seqs: int = 16  # sequences running in one step
    prefix_caching: bool = True
    ignore_eos: bool = False  # decode max_new_tokens whatever is sampled (benchmarks of a fixed shape, as vLLM's)
    token_budget: int | None = None  # tokens one step feeds over all sequences (chunked prefill); None: no limit

    def __post_init__(self) -> None:
        check_int("max_seqs", self.max_seqs, 1, MAX_SEQUENCES)
        if self.pool_pages is not None:
            check_int("pool_pages", self.pool_pages, 1, 1 << 20)
        if self.token_budget is not None:
            check_int("token_budget", self.token_budget, 1, 1 << 20)


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    kind: str  # "prefill", "decode" or "fork" (a parallel sample that took its parent's first logits)
    n_tokens: int
    next_token: int  # -1 when this step did not end the sequence's known tokens


@dataclass(frozen=True)
class BatchRecord:
    """One engine step, with the pool as the sequences view shows it (layer 0). Events are every cache
    event of the step but token writes (the one-request session's records keep those)."""

    step: int
    seqs: tuple[SeqStep, ...]
    events: tuple[CacheEvent, ...]
    block_tables: dict[int, tuple[int, ...]]  # running sequence -> its layer-0 pages in logical order
    ref_counts: np.ndarray  # (pool_pages,) int32
    fill: np.ndarray  # (pool_pages,) tokens per page
    cached_free: tuple[int, ...]  # free pages still holding a cached prefix, next reused first
    pages_used: int
    pages_unshared: int  # what the live sequences would hold without sharing
    contiguous_reserved_tokens: int  # what per-sequence contiguous allocation would reserve
    tokens_stored: int  # tokens in used pages (shared ones once)
    seconds: float
    n_cached: dict[int, int] = field(default_factory=dict)  # running sequence -> tokens in the pool after the step
    waiting: int = 0  # requests waiting after the step
    ended: tuple[int, ...] = ()  # requests that ended in this step (any stop reason)

    @property
    def tokens_decoded(self) -> int:
        return sum(1 for s in self.seqs if s.next_token >= 0)

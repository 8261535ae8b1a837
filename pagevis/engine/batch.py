"""What many-sequence decoding is configured with, and what each engine step records.

The engine itself (scheduler, batched forward, sampling) is pagevis.engine.engine.Engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagevis import settings
from pagevis.kvcache import CacheEvent
from pagevis.kvcache.memory import HybridBytes
from pagevis.settings import MAX_SEQUENCES, field_for

__all__ = ["MAX_CHUNK", "MAX_SEQUENCES", "BatchConfig", "BatchRecord", "SeqStep", "int8_rows_of"]
MAX_CHUNK = settings.setting("max_chunk").default  # prompt tokens one sequence feeds per step (the table's)


@dataclass(frozen=True)
class BatchConfig:
    """Many sequences over one pool; defaults, bounds and help in the settings table (pagevis/settings.py)."""

    pool_pages: int | None = field_for("pool_pages")  # page ids per layer; None: max_seqs sequences' worth
    max_seqs: int = field_for("max_seqs")  # sequences running in one step
    prefix_caching: bool = field_for("prefix_caching")
    ignore_eos: bool = field_for("ignore_eos")  # decode max_new_tokens whatever is sampled (fixed-shape benches)
    token_budget: int | None = field_for("token_budget")  # tokens one step feeds (chunked prefill); None: no limit
    # which rows take int8 activations with integer dot products where the CPU has AVX-512 VNNI (model/int8_rows.py),
    # the others exact float32: "none", "batched" (decode rows of several sequences), "prompts" (and every prompt
    # row), "all" (every row); int8_rows_of
    int8_rows: str = field_for("int8_rows")

    def __post_init__(self) -> None:
        settings.check(self, ("max_seqs", "pool_pages", "token_budget", "int8_rows"))


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    kind: str  # "prefill", "decode" or "fork" (a parallel sample that took its parent's first logits)
    n_tokens: int
    next_token: int  # -1 when this step did not end the sequence's known tokens

    @property
    def feeds_prompt(self) -> bool:
        """Whether the step fed this sequence prompt rows (a prefill chunk, or more than one token)."""
        return self.kind == "prefill" or self.n_tokens > 1


@dataclass(frozen=True)
class BatchRecord:
    """One engine step, with the pool as the sequences view shows it (layer 0); its counts of pages and tokens are
    the fullest layer's (each layer has its own pool: on Gemma 3 layer 0 is a sliding-window layer). Events are every
    cache event of the step but token writes (the one-request session's records keep those)."""

    step: int
    seqs: tuple[SeqStep, ...]
    events: tuple[CacheEvent, ...]
    block_tables: dict[int, tuple[int, ...]]  # running sequence -> its layer-0 pages in logical order
    ref_counts: np.ndarray  # (pool_pages,) int32
    fill: np.ndarray  # (pool_pages,) tokens per page
    cached_free: tuple[int, ...]  # free pages still holding a cached prefix, next reused first
    pages_used: int  # of the fullest layer's pool (over every layer; layer 0's on a tie)
    pages_unshared: int  # what the live sequences would hold without sharing, in that layer
    contiguous_reserved_tokens: int  # what per-sequence contiguous allocation would reserve
    tokens_stored: int  # tokens in that layer's used pages (shared ones once)
    seconds: float
    n_cached: dict[int, int] = field(default_factory=dict)  # running sequence -> tokens in the pool after the step
    waiting: int = 0  # requests waiting after the step
    ended: tuple[int, ...] = ()  # requests that ended in this step (any stop reason)
    # a model with sliding-window layers: the pool's bytes in use by layer type against a cache without windows
    # (kvcache.memory.HybridBytes); None otherwise
    hybrid: HybridBytes | None = None

    @property
    def tokens_decoded(self) -> int:
        return sum(1 for s in self.seqs if s.next_token >= 0)


def int8_rows_of(plan, mode: str) -> tuple[bool, tuple[np.ndarray, ...]]:
    """Whether a step's forward takes int8 rows (model/int8_rows.py), and the masks of those rows when not all are:
    a step's plan (request, tokens fed, first position) under BatchConfig.int8_rows `mode` -- "none": no row;
    "batched": decode rows (one generated token fed) when two or more sequences decode in the step; "prompts": those
    and every prompt row; "all": every row. A request scoring its prompt (prompt_logprobs) keeps every row exact,
    and only it: the others' rows are what they would be without it. Masks (over the token rows, and over the logit
    rows: every row of a scoring request, the last of another) when some rows are int8 and others not; else none."""
    if mode == "none":
        return False, ()
    scoring = [request.prompt_logprobs is not None for request, _, _ in plan]
    decoding = [len(tokens) == 1 and start >= len(request.prompt_ids) for request, tokens, start in plan]
    batched = sum(decode and not scores for decode, scores in zip(decoding, scoring, strict=True)) >= 2
    chosen = [not scores and (mode == "all" or (batched if decode else mode == "prompts"))
              for decode, scores in zip(decoding, scoring, strict=True)]
    if not any(chosen):
        return False, ()
    if all(chosen):
        return True, ()
    rows = np.repeat(chosen, [len(tokens) for _, tokens, _ in plan])
    logits = np.repeat(chosen, [len(tokens) if scores else 1 for (_, tokens, _), scores in zip(plan, scoring, strict=True)])
    return True, (rows, logits)

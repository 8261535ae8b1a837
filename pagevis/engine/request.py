"""A request: one sequence the engine decodes, from its prompt to its stop reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagevis.engine.logprobs import Scores
from pagevis.engine.sampling import Sampler


@dataclass
class Request:
    seq_id: int
    prompt_ids: tuple[int, ...]
    sampler: Sampler
    max_new_tokens: int
    ignore_eos: bool = False  # decode max_new_tokens whatever is sampled (benchmarks of a fixed shape)
    stop: tuple[str, ...] = ()  # stop strings: the request ends when its text contains one
    stop_state: list | None = None  # the engine's (decoder, StopMatcher, tokens fed) for `stop`
    generated: list[int] = field(default_factory=list)
    n_cached: int = 0  # tokens whose K/V are in the pool
    started: int = -1  # admission order (preemption takes the highest)
    # why it ended, set by the engine (Engine._end): eos, max_new_tokens, stop, cache_full, swap_full, or cancel's
    # reason (cancelled, interrupted, abort, error); serve/core.py sets "error" itself when ending it failed
    stop_reason: str | None = None
    error: str = ""  # with stop_reason cache_full, swap_full or error: why
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at its (last) admission
    cache_salt: str | None = None  # vLLM's cache_salt: only requests with the same salt share cached pages
    # its prompt's K/V are exact where other requests' are int8 (it scores its prompt under BatchConfig.int8_rows
    # "prompts" or "all"): its pages are cached under a salt of their own (`prefix_salt`), never another's hit
    exact_pages: bool = False
    children: list[int] = field(default_factory=list)  # parallel samples waiting for this one's prefill
    paused: bool = False  # held between calls (a session stepped over HTTP): not scheduled, pages kept
    hold: bool = False  # keep its pages when it finishes, until Engine.release (a server's session records them)
    steps: int = 0  # engine steps that fed it tokens
    policy: object = None  # an eviction policy object to use instead of the settings' (bench's future-aware one)
    # Log-probabilities asked for (None: not wanted), each with its top-k count (logprobs.Scores):
    logprobs: int | None = None  # of each generated token, into `token_scores` (one row per generated token)
    prompt_logprobs: int | None = None  # of each prompt token after the first, into `prompt_scores`; such a
    # request takes nothing from the prefix cache (its tokens' logits are the point)
    token_scores: list = field(default_factory=list)
    prompt_scores: Scores | None = None  # logprobs.Scores over positions 0..len(prompt)-2 (row p scores token p+1)

    @property
    def tokens(self) -> list[int]:
        """Every token so far, prompt then generated: a new list (the engine's step asks n_tokens and tokens_in)."""
        return [*self.prompt_ids, *self.generated]

    @property
    def prefix_salt(self) -> str | None:
        """The salt its pages' prefix hashes start from: cache_salt, set apart for exact pages (`exact_pages`)."""
        return f"{self.cache_salt or ''}\x00exact" if self.exact_pages else self.cache_salt

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def tokens_in(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] (0 <= start <= stop), without building the whole list: a decode step's one token."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.generated[start - n: stop - n]
        return [*self.prompt_ids[start:stop], *self.generated[:max(0, stop - n)]]

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

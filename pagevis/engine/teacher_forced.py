"""Teacher forcing: a session reads a fixed text and each step scores the text's next tokens.

The text is the session's prompt, so the session's own prefill chunking, eviction and events decide what the
bounded cache holds; a LogitsTap keeps the logits of every token of each chunk (the session only needs the
last). Each step returns the log-probabilities its forward gave every token it read, and the negative
log-likelihood of each true next token. `pagevis compare` (its bounded rows), `pagevis run --teacher-forced`
and the A/B window's "same text" mode all score through this one class.

The chunk sizes: `first_chunk` tokens in the first step (None: as many as fit the free slots), then `chunk`
tokens per step (None: as many as fit — one token a step once the cache is full). compare reads a budget at
once, then one token a step; the app reads a warm-up the cache holds whole, then one token a step. Either way
every token is predicted from exactly the cache a token-by-token run would have had.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from pagevis.engine.logits_tap import LogitsTap
from pagevis.engine.step_record import StepRecord
from pagevis.engine.sampling import log_softmax
from pagevis.engine.session import DecodeSession
from pagevis.engine.session_config import SessionConfig


class ForcedStep(NamedTuple):
    """One step of a teacher-forced session: what it read and how well it predicted the text."""

    record: StepRecord
    positions: np.ndarray  # (k,) the positions p whose next token (the text's p + 1) this step scored
    logits: np.ndarray  # (k, vocab) the bounded cache's logits at each of them (log_softmax(row): its log-probs)
    nll: np.ndarray  # (k,) -log p(text[p + 1]), float64


class TeacherForced:
    """A DecodeSession reading `token_ids` as its prompt (no chat template, one token sampled at the end, no
    oracle); step() returns a ForcedStep. `policy`: a policy object instead of the settings' one."""

    def __init__(self, model, token_ids, config: SessionConfig, policy=None, piece: int = 256,
                 first_chunk: int | None = None, chunk: int | None = None):
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.tap = LogitsTap(model, piece)
        config = replace(config, max_new_tokens=1, chat=False, oracle=False)
        self.session = DecodeSession(self.tap, "", config, prompt_ids=[int(t) for t in self.token_ids],
                                     policy=policy, max_chunk=first_chunk)
        self._chunk = chunk
        self._first = True

    @property
    def done(self) -> bool:
        return self.session.done

    @property
    def stop_reason(self) -> str | None:
        return self.session.stop_reason

    def step(self) -> ForcedStep:
        self.tap.clear()
        record = self.session.step()
        if self._first:
            self._first = False
            self.session.engine.scheduler.max_chunk = self._chunk  # after the first chunk: `chunk` a step
        logits = self.tap.logits[0]  # every token of the step's own forward (a compressing pass comes after)
        self.tap.clear()
        n = len(self.token_ids)
        positions = np.asarray(record.positions, dtype=np.int64)
        scored = positions < n - 1  # the last token of the text predicts nothing in it
        rows = np.atleast_2d(logits)[: len(positions)][scored]
        positions = positions[scored]
        nll = np.array([-log_softmax(row)[token] for row, token in zip(rows, self.token_ids[positions + 1])],
                       dtype=np.float64)
        return ForcedStep(record, positions, rows, nll)

    def close(self) -> None:
        self.session.close()


def perplexity(nll) -> float | None:
    """exp of the mean negative log-likelihood (None for no tokens)."""
    nll = np.asarray(nll, dtype=np.float64)
    return float(np.exp(np.mean(nll))) if nll.size else None

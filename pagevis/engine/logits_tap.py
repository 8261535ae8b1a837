"""The model as a session sees it, keeping the logits its forwards computed: what the A/B pair compares (the
next-token distributions of two sessions) and what the quality bench scores (every teacher-forced token)."""

from __future__ import annotations

import numpy as np


class LogitsTap:
    """Wraps a model (every other attribute is the model's); each forward's logits are kept in `logits` until
    `clear()`. A session's own prediction is its step's first forward (an oracle's comes after).

    With `piece`, a forward computes the logits of all its tokens, in pieces of at most `piece` tokens, and
    keeps them all: a session prefills a whole budget at once, and one piece's attention weights (piece x
    heads x keys, float32) stay small where a 4,096-token chunk's would take 600 MB. The pieces are
    consecutive and the chunk fits the free slots, so nothing is evicted between them and every query sees
    what it would have seen in one call."""

    def __init__(self, model, piece: int | None = None):
        self._model = model
        self.piece = piece
        self.logits: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, token_ids, positions, attend, all_logits=False, logit_rows=None):
        if self.piece is None:
            logits = self._model.forward(token_ids, positions, attend, all_logits=all_logits,
                                         logit_rows=logit_rows)
            self.logits.append(logits)
            return logits
        pieces = [self._model.forward(token_ids[i: i + self.piece], positions[i: i + self.piece], attend,
                                      all_logits=True) for i in range(0, len(token_ids), self.piece)]
        every = np.concatenate([np.atleast_2d(p) for p in pieces])
        self.logits.append(every)
        if logit_rows is not None:
            return every[logit_rows]
        return every if all_logits else every[-1]

    def clear(self) -> None:
        self.logits = []

"""Log-probabilities a request asked for: of the token that came next (sampled, or the prompt's own when
the prompt is scored) and the k most likely tokens, from the raw logits (no temperature, top-k or top-p:
what the model assigns, as vLLM and OpenAI report them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20  # top tokens per position a request may ask for (OpenAI's and vLLM's limit)
_ROWS = 32  # logits rows turned into float64 at once (32 x 49,152 x 8 bytes = 12.6 MB for SmolLM2)


@dataclass
class Scores:
    """Per position: the log-probability of the token that followed, and the top-k tokens' ids and
    log-probabilities, most likely first."""

    chosen: np.ndarray  # (n,) float64
    top_ids: np.ndarray  # (n, k) int64
    top: np.ndarray  # (n, k) float64

    @classmethod
    def empty(cls, n: int, k: int) -> Scores:
        return cls(np.full(n, np.nan), np.zeros((n, k), dtype=np.int64), np.full((n, k), np.nan))

    def put(self, start: int, other: Scores) -> None:
        """Write other's rows at positions start.. (a recomputed prefill overwrites what it had)."""
        end = start + len(other.chosen)
        self.chosen[start:end], self.top_ids[start:end], self.top[start:end] = other.chosen, other.top_ids, other.top

    def row(self, i: int) -> tuple[float, list[int], list[float]]:
        return float(self.chosen[i]), self.top_ids[i].tolist(), self.top[i].tolist()


def score(logits: np.ndarray, chosen, k: int) -> Scores:
    """Scores of logits rows (n, vocab) for the tokens `chosen` (n,) and the top k of each row."""
    logits = np.atleast_2d(logits)
    chosen = np.asarray(chosen, dtype=np.int64).reshape(-1)
    out = Scores.empty(len(chosen), k)
    for start in range(0, len(chosen), _ROWS):
        block = logits[start:start + _ROWS].astype(np.float64)
        block -= block.max(axis=1, keepdims=True)
        block -= np.log(np.exp(block).sum(axis=1, keepdims=True))
        rows = np.arange(len(block))
        out.chosen[start:start + len(block)] = block[rows, chosen[start:start + len(block)]]
        if k:
            top = np.argpartition(block, -k, axis=1)[:, -k:]
            values = np.take_along_axis(block, top, axis=1)
            order = np.argsort(-values, axis=1, kind="stable")
            out.top_ids[start:start + len(block)] = np.take_along_axis(top, order, axis=1)
            out.top[start:start + len(block)] = np.take_along_axis(values, order, axis=1)
    return out

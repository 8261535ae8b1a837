"""A/B: two sessions on the same prompt with different cache settings, stepped in lockstep. Qt-free.

Each lockstep step advances A, then B, by one step and compares their next-token distributions: KL(A‖B)
and whether both put the same token first. A session's own oracle (if on) compares it with the full cache.
Both sessions sample their own tokens, so once they choose differently the texts diverge; the log says
where. Per step the comparison costs a few floats; the records go to each side's bounded Timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagevis.engine import DecodeSession, SessionConfig, StepRecord
from pagevis.engine.logits_tap import LogitsTap
from pagevis.engine.sampling import log_softmax
from pagevis.viewmodel.spill import _grow
from pagevis.viewmodel.timeline import Timeline


class ABConfig(NamedTuple):
    a: SessionConfig
    b: SessionConfig


@dataclass(frozen=True)
class Comparison:
    """A against B at one lockstep step (NaN / False where the steps predict nothing comparable)."""

    kl_ab: float  # KL(A‖B) of the next-token distributions, nats
    top1_agree: bool
    same_token: bool  # both sampled the same next token


class LockstepStep(NamedTuple):
    a: StepRecord
    b: StepRecord
    comparison: Comparison


class LockstepPair:
    """Two DecodeSessions stepped together; looks like one session to the runner (step(), done)."""

    def __init__(self, a: DecodeSession, b: DecodeSession, tap_a: LogitsTap, tap_b: LogitsTap):
        self.a, self.b = a, b
        self._taps = (tap_a, tap_b)

    @property
    def done(self) -> bool:
        return self.a.done or self.b.done

    @property
    def stop_reason(self) -> str | None:
        if not self.done:
            return None
        return "; ".join(f"{side}: {s.stop_reason}" for side, s in (("A", self.a), ("B", self.b)) if s.done)

    def step(self) -> LockstepStep:
        records, logits = [], []
        for session, tap in zip((self.a, self.b), self._taps):
            tap.clear()
            records.append(session.step())
            logits.append(tap.logits[0] if tap.logits else None)
        return LockstepStep(records[0], records[1], compare(records[0], records[1], *logits))


def compare(a: StepRecord, b: StepRecord, logits_a, logits_b) -> Comparison:
    """Compare two steps' predictions when both predict the token after the same position."""
    predicts = a.next_token >= 0 and b.next_token >= 0 and a.positions[-1] == b.positions[-1]
    if not predicts or logits_a is None or logits_b is None:
        return Comparison(float("nan"), False, False)
    pa, pb = log_softmax(np.asarray(logits_a)), log_softmax(np.asarray(logits_b))
    return Comparison(float(np.sum(np.exp(pa) * (pa - pb))), bool(np.argmax(pa) == np.argmax(pb)),
                      a.next_token == b.next_token)


COLUMNS = ("kl_ab", "top1_agree", "same_token", "kl_a_full", "kl_b_full")


class ABTimeline:
    """Both sides' timelines and the comparison per step (5 floats a step)."""

    def __init__(self, a: Timeline, b: Timeline):
        self.a, self.b = a, b
        self.info = a.info
        self._log = np.zeros((0, len(COLUMNS)), dtype=np.float64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def extend(self, steps: list[LockstepStep]) -> None:
        for step in steps:
            self.a.extend([step.a])
            self.b.extend([step.b])
            c = step.comparison
            self._log = _grow(self._log, self._count)
            self._log[self._count] = (c.kl_ab, float(c.top1_agree) if c.kl_ab == c.kl_ab else np.nan,
                                      float(c.same_token) if c.kl_ab == c.kl_ab else np.nan,
                                      step.a.oracle.kl if step.a.oracle else np.nan,
                                      step.b.oracle.kl if step.b.oracle else np.nan)
            self._count += 1

    def series(self, name: str) -> np.ndarray:
        return self._log[: self._count, COLUMNS.index(name)].copy()

    def first_divergence(self) -> int | None:
        """The first step at which A and B sampled different tokens, or None."""
        different = np.flatnonzero(self.series("same_token") == 0.0)
        return int(different[0]) if different.size else None

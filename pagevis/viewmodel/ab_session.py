"""A/B: two sessions with different cache settings, stepped in lockstep. Qt-free.

Free-running (LockstepPair): both sessions decode the same prompt, each sampling its own tokens. Per step A and
B's next-token distributions are compared (KL(A‖B), the same top-1) while they predict after the same text;
once they sample differently the texts diverge and KL(A‖B) only says that the texts differ, so it is kept up
to the divergence. What shows a collapse then is each side's own text: its repetition rate (the share of its
recent tokens that repeat a 4-gram it already wrote) and, with the oracle on, the full cache's log-probability
of the tokens it chose.

Teacher-forced (ForcedPair, "same text"): both sides read the same text, and beside them the full cache (a
third session that never evicts); each step scores every side's prediction of the text's next tokens, so the
running perplexities are `pagevis compare`'s numbers for the same text and caches. The first step reads a
warm-up the smallest cache holds whole (the three caches are identical there), then one token a step.
"""

from __future__ import annotations

import html
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from pagevis.engine import DecodeSession, SessionConfig, StepRecord
from pagevis.engine.logits_tap import LogitsTap
from pagevis.engine.sampling import log_softmax
from pagevis.engine.teacher_forced import ForcedStep, TeacherForced
from pagevis.kvcache.policies import policy_params
from pagevis.viewmodel.spill import _grow
from pagevis.viewmodel.timeline import Timeline

WARM_UP_MARGIN = 16  # tokens the smallest cache still has free after the warm-up: its first eviction comes this many steps in
MAX_FORCED_TOKENS = 1024  # tokens of a text the "same text" mode reads (the full cache holds them all)
REPEAT_N = 4  # a token repeats when the 4-gram it ends was written before
REPEAT_WINDOW = 64  # the repetition rate is over this many newest tokens


class ABConfig(NamedTuple):
    a: SessionConfig
    b: SessionConfig


@dataclass(frozen=True)
class Comparison:
    """A against B at one lockstep step (NaN / False where the steps predict nothing comparable)."""

    kl_ab: float  # KL(A‖B) of the next-token distributions, nats
    top1_agree: bool
    same_token: bool  # both sampled the same next token (teacher-forced: both read the same one)


class ForcedScores(NamedTuple):
    """One teacher-forced step: the positions p whose next token (the text's p + 1) all three scored."""

    positions: np.ndarray
    nll: tuple[np.ndarray, np.ndarray, np.ndarray]  # A, B, the full cache: -log p(text[p + 1]) each
    kl_full: tuple[float, float]  # mean KL(full‖A), KL(full‖B) over the step's positions


class LockstepStep(NamedTuple):
    a: StepRecord
    b: StepRecord
    comparison: Comparison
    forced: ForcedScores | None = None


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
        return _stop_reason(self.a, self.b)

    def step(self) -> LockstepStep:
        records, logits = [], []
        for session, tap in zip((self.a, self.b), self._taps):
            tap.clear()
            records.append(session.step())
            logits.append(tap.logits[0] if tap.logits else None)
        return LockstepStep(records[0], records[1], compare(records[0], records[1], *logits))


def _stop_reason(a, b) -> str | None:
    if not (a.done or b.done):
        return None
    return "; ".join(f"{side}: {s.stop_reason}" for side, s in (("A", a), ("B", b)) if s.done)


def warm_up(configs, n_tokens: int) -> int:
    """Tokens the teacher-forced pair reads in its first step: what the smallest cache holds with
    WARM_UP_MARGIN slots to spare (at least one token, at most the text's predictions)."""
    return max(1, min(min(c.capacity for c in configs) - WARM_UP_MARGIN, n_tokens - 1))


def full_cache_config(config: SessionConfig, n_tokens: int) -> SessionConfig:
    """The never-evicting cache the teacher-forced pair scores against (compare's full cache: float32, whole
    keys, every token of the text)."""
    return replace(SessionConfig(), page_size=config.page_size, max_pages=math.ceil(n_tokens / config.page_size),
                   policy="none", record_layers=())


class ForcedPair:
    """A and B teacher-forced through the same text one token a step (after the warm-up), the full cache
    beside them; looks like one session to the runner."""

    def __init__(self, a: TeacherForced, b: TeacherForced, full: TeacherForced):
        self.a, self.b, self.full = a, b, full

    @classmethod
    def build(cls, model, token_ids, configs: ABConfig, piece: int = 64) -> ForcedPair:
        first = warm_up(configs, len(token_ids))
        a, b = (TeacherForced(model, token_ids, c, piece=piece, first_chunk=first, chunk=1) for c in configs)
        full = TeacherForced(model, token_ids, full_cache_config(configs.a, len(token_ids)), piece=piece,
                             first_chunk=first, chunk=1)
        return cls(a, b, full)

    @property
    def done(self) -> bool:
        return self.a.done or self.b.done

    @property
    def stop_reason(self) -> str | None:
        """"end of text" once the sides have read the whole text (their sessions call it max_new_tokens)."""
        return "end of text" if self.done else None

    def step(self) -> LockstepStep:
        a, b, full = self.a.step(), self.b.step(), self.full.step()
        # the full cache's record is not shown: keep the count, not the arrays
        self.full.session.records[-1] = None  # type: ignore[call-overload]
        if not len(a.positions):  # the last token: it predicts nothing in the text
            nan = float("nan")
            return LockstepStep(a.record, b.record, Comparison(nan, False, True),
                                ForcedScores(a.positions, (a.nll, b.nll, full.nll), (nan, nan)))
        last_a, last_b = log_softmax(a.logits[-1]), log_softmax(b.logits[-1])
        comparison = Comparison(float(np.sum(np.exp(last_a) * (last_a - last_b))),
                                bool(np.argmax(last_a) == np.argmax(last_b)), True)
        kl_full = (_mean_kl(full, a), _mean_kl(full, b))
        return LockstepStep(a.record, b.record, comparison, ForcedScores(a.positions, (a.nll, b.nll, full.nll),
                                                                         kl_full))

    def close(self) -> None:
        for side in (self.a, self.b, self.full):
            side.close()


def _mean_kl(full: ForcedStep, side: ForcedStep) -> float:
    """Mean KL(full‖side) over the step's positions (compare's mean_kl, per step)."""
    kls = []
    for f_row, s_row in zip(full.logits, side.logits):
        f, s = log_softmax(f_row), log_softmax(s_row)
        kls.append(float(np.sum(np.exp(f) * (f - s))))
    return float(np.mean(kls))


def compare(a: StepRecord, b: StepRecord, logits_a, logits_b) -> Comparison:
    """Compare two steps' predictions when both predict the token after the same position."""
    predicts = a.next_token >= 0 and b.next_token >= 0 and a.positions[-1] == b.positions[-1]
    if not predicts or logits_a is None or logits_b is None:
        return Comparison(float("nan"), False, False)
    pa, pb = log_softmax(np.asarray(logits_a)), log_softmax(np.asarray(logits_b))
    return Comparison(float(np.sum(np.exp(pa) * (pa - pb))), bool(np.argmax(pa) == np.argmax(pb)),
                      a.next_token == b.next_token)


class Repetition:
    """One side's repetition rate: the share of its newest REPEAT_WINDOW tokens that end a REPEAT_N-gram it
    had already written (a side stuck in a loop approaches 1; fluent text stays near 0)."""

    def __init__(self):
        self.tokens: list[int] = []
        self._seen: set[tuple[int, ...]] = set()
        self._flags: deque[bool] = deque(maxlen=REPEAT_WINDOW)

    def add(self, token: int) -> float:
        self.tokens.append(int(token))
        if len(self.tokens) >= REPEAT_N:
            gram = tuple(self.tokens[-REPEAT_N:])
            self._flags.append(gram in self._seen)
            self._seen.add(gram)
        return self.rate

    @property
    def rate(self) -> float:
        return float(np.mean(self._flags)) if self._flags else float("nan")


COLUMNS = ("kl_ab", "top1_agree", "same_token", "kl_a_full", "kl_b_full", "lp_a_full", "lp_b_full", "rep_a",
           "rep_b", "scored", "evictions_a", "evictions_b", "held_a", "held_b")
SIDES = ("a", "b", "full")


class ABTimeline:
    """Both sides' timelines and the comparison per step (a few floats a step); teacher-forced, every scored
    token's NLL for A, B and the full cache, by position."""

    def __init__(self, a: Timeline, b: Timeline, forced: bool = False):
        self.a, self.b = a, b
        self.info = a.info
        self.forced = forced
        self._log = np.zeros((0, len(COLUMNS)), dtype=np.float64)
        self._count = 0
        self._nll = np.zeros((0, len(SIDES)), dtype=np.float64)  # teacher-forced: per position p (predicting p + 1)
        self._scored = 0
        self._repetition = (Repetition(), Repetition())

    def __len__(self) -> int:
        return self._count

    def extend(self, steps: list[LockstepStep]) -> None:
        for step in steps:
            self.a.extend([step.a])
            self.b.extend([step.b])
            self._log = _grow(self._log, self._count)
            self._log[self._count] = (*self._row(step), step.a.evictions_total, step.b.evictions_total,
                                      step.a.resident_tokens, step.b.resident_tokens)
            self._count += 1

    def _row(self, step: LockstepStep) -> tuple:
        c = step.comparison
        compared = c.kl_ab == c.kl_ab
        if step.forced is not None:
            f = step.forced
            for i in range(len(f.positions)):
                self._nll = _grow(self._nll, self._scored)
                self._nll[self._scored] = [nll[i] for nll in f.nll]
                self._scored += 1
            return (c.kl_ab, float(c.top1_agree) if compared else np.nan, 1.0, *f.kl_full, np.nan, np.nan,
                    np.nan, np.nan, self._scored)
        rates = [rep.add(r.next_token) if r.next_token >= 0 else rep.rate
                 for rep, r in zip(self._repetition, (step.a, step.b))]
        return (c.kl_ab, float(c.top1_agree) if compared else np.nan,
                float(c.same_token) if compared else np.nan,
                *(r.oracle.kl if r.oracle else np.nan for r in (step.a, step.b)),
                *(r.oracle.logprob_full if r.oracle and r.next_token >= 0 else np.nan for r in (step.a, step.b)),
                *rates, 0)

    def series(self, name: str) -> np.ndarray:
        return self._log[: self._count, COLUMNS.index(name)].copy()

    def first_divergence(self) -> int | None:
        """The first step at which A and B sampled different tokens, or None."""
        different = np.flatnonzero(self.series("same_token") == 0.0)
        return int(different[0]) if different.size else None

    def held(self, side: str, index: int) -> tuple[float, int, int] | None:
        """Tokens side "a" or "b" held (layer 0) from its first eviction to step `index`: mean, least, most;
        None before it first evicted."""
        first = self.first_eviction(side)
        if first is None or first > index:
            return None
        held = self.series(f"held_{side}")[first: index + 1]
        return float(held.mean()), int(held.min()), int(held.max())

    def held_apart(self, index: int, layer: int = 0) -> int:
        """Token positions one side holds in `layer` and the other does not, at step `index`."""
        kept = [set(m[m >= 0].tolist()) for m in (side.record(index).slot_maps[layer] for side in (self.a, self.b))]
        return len(kept[0] ^ kept[1])

    # --- teacher-forced ----------------------------------------------------------------------------
    def scored_at(self, index: int) -> int:
        """Tokens scored up to and including step `index` (teacher-forced)."""
        return int(self._log[index, COLUMNS.index("scored")]) if 0 <= index < self._count else 0

    def first_eviction(self, side: str) -> int | None:
        """The first step at which side "a" or "b" evicted, or None."""
        evicted = np.flatnonzero(self.series(f"evictions_{side}") > 0)
        return int(evicted[0]) if evicted.size else None

    def nll(self, side: str, upto: int | None = None) -> np.ndarray:
        """Each scored token's NLL (side "a", "b" or "full"), the first `upto` of them."""
        return self._nll[: self._scored if upto is None else min(upto, self._scored), SIDES.index(side)].copy()

    def running_ppl(self, side: str, upto: int | None = None) -> np.ndarray:
        """Perplexity over the first k scored tokens, for k = 1 .. upto."""
        nll = self.nll(side, upto)
        return np.exp(np.cumsum(nll) / np.arange(1, len(nll) + 1))

    def ppl(self, side: str, upto: int) -> float | None:
        nll = self.nll(side, upto)
        return float(np.exp(np.mean(nll))) if len(nll) else None


def side_labels(configs: ABConfig) -> tuple[str, str]:
    """How every legend and headline names the sides: "A" / "B" and what differs between them — the policy,
    the pages ("A 8×8" / "B 2×32"), the sinks, what a full cache frees at once ("A frees pages" / "B frees
    tokens") — so that two sides of one policy are never named alike."""
    return _side_label("A", configs.a, configs.b), _side_label("B", configs.b, configs.a)


def _side_label(name: str, mine: SessionConfig, other: SessionConfig) -> str:
    parts = [mine.policy] if mine.policy != other.policy else []
    if (mine.page_size, mine.max_pages) != (other.page_size, other.max_pages):
        parts.append(f"{mine.max_pages}×{mine.page_size}")
    for describe_side in (_sinks, _freed):
        if describe_side(mine) != describe_side(other):
            parts.append(describe_side(mine))
    return f"{name} " + (", ".join(parts) or mine.policy)


def _sinks(config: SessionConfig) -> str:
    return f"{dict(config.policy_params).get('n_sink', 'default')} sinks"


def _freed(config: SessionConfig) -> str:
    """What a full cache frees at once: tokens (one a step), pages (a page's worth), or n tokens."""
    n = int(dict(config.policy_params).get("compress_every", policy_params(config.policy)["compress_every"]))
    return "frees tokens" if n == 1 else "frees pages" if n == config.page_size else f"frees {n} at once"


def held_text(timeline: ABTimeline, index: int, labels: tuple[str, str]) -> str:
    """"held A … 60 (57-64) · B … 48 (33-64)": the tokens each side held since its first eviction."""
    parts = []
    for label, side in zip(labels, "ab"):
        held = timeline.held(side, index)
        if held is not None:
            mean, low, high = held
            parts.append(f"{html.escape(label.split(' ')[0])} {mean:.0f}" + (f" ({low}-{high})" if low != high else ""))
    return "tokens held " + " · ".join(parts) if parts else ""


GOOD, WARN, PLAIN = "#7ee787", "#ffb020", "#d8dce3"


def describe(timeline: ABTimeline | None, index: int, labels: tuple[str, str] = ("A", "B")) -> str:
    """The A/B's headline at step `index` (HTML): teacher-forced, the perplexities over the tokens read so far
    (`pagevis compare --tokens N+1`'s numbers for the same text and caches); free-running, where the texts
    diverge and each side's repetition rate (and, with the oracle, the full cache's log-probability of its
    tokens)."""
    if timeline is None or index < 0:
        return ""
    a, b = timeline.a.record(index), timeline.b.record(index)
    layers = timeline.info.n_layers
    short = [html.escape(label.split(" ")[0]) for label in labels]
    evictions = (f"step {index}: evicted per layer {short[0]} {a.evictions_total / layers:.0f} · "
                 f"{short[1]} {b.evictions_total / layers:.0f}")
    if timeline.forced:
        scored = timeline.scored_at(index)
        ppl = [timeline.ppl(side, scored) for side in SIDES]
        if ppl[0] is None:
            return evictions
        held = held_text(timeline, index, labels)
        return (f"<b>ppl after {scored} tokens: full {ppl[2]:.1f} · {html.escape(labels[0])} {ppl[0]:.1f} · "
                f"{html.escape(labels[1])} {ppl[1]:.1f}</b>" + (f" · <b>{held}</b>" if held else "") +
                f" · {evictions}")
    parts = [evictions]
    if a.evictions_total or b.evictions_total:
        parts.append(f"<b>the grids hold {timeline.held_apart(index)} different tokens</b>")
    diverged = timeline.first_divergence()
    if diverged is None or diverged > index:
        kl = timeline.series("kl_ab")[index]
        if kl == kl:
            parts.append(f"KL(A‖B) {kl:.3f} nats")
        parts.append(f"<span style='color:{GOOD}'>the texts agree so far</span>")
    else:
        ra, rb = timeline.a.record(diverged), timeline.b.record(diverged)
        parts.append(f"<span style='color:{WARN}'>the texts diverge at step {diverged} "
                     f"({html.escape(repr(ra.next_text))} vs {html.escape(repr(rb.next_text))})</span>")
    for label, side in zip(labels, "ab"):
        rate = timeline.series(f"rep_{side}")[index]
        lp = timeline.series(f"lp_{side}_full")[: index + 1]
        text = f"{html.escape(label)}: repeats {rate:.0%}" if rate == rate else ""
        if np.isfinite(lp).any():
            text += f", full cache's log-prob of its tokens {np.nanmean(lp[-REPEAT_WINDOW:]):.2f}"
        if text:
            parts.append(f"<span style='color:{WARN if rate >= 0.5 else PLAIN}'>{text}</span>")
    return " · ".join(parts)

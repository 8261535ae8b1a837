"""Requests arriving at a server, seeded: what the Server window (and its bench) feeds the engine. Qt-free.

Three workloads, each from the shipped public-domain text (resources/texts, Pride and Prejudice ch. 1-6):

- `chat`: every request opens with one shared system prompt (a passage to answer questions about) and asks
  its own question about one sentence of the book. The prefix cache computes the system prompt once.
- `returning`: users come back. A user's first turn is a paragraph and a request to go on; once the answer is
  done the user thinks (an exponential pause) and sends the next turn, whose prompt is the whole previous
  turn — prompt and answer, token for token — plus a new message: the previous turn is its prefix.
- `documents`: each request is a different long passage to summarise; nothing is shared, and a small pool
  runs out of pages mid-decode, so the scheduler preempts (and later recomputes) the newest request.

First turns arrive as a Poisson process (`PoissonGaps`): gaps are unit exponentials from the seed, scaled by
the arrival rate in force when the gap is drawn (so a rate change applies from the next arrival on). Arrivals are generated
once, in order, and shared: both sides of an A/B read the same `ArrivalSchedule` and see the same requests at
the same times. Follow-up turns depend on when (and with what) the previous turn ended, so each side makes its
own; their messages and think times are seeded by (seed, user, turn), the same on both sides.

The chat requests' messages (`first_turn`, `returning_turn`) and the Poisson gaps are also what `pagevis
bench serve` (bench/serving.py) sends a real server, over its own system prompts and questions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

from pagevis.errors import ConfigError, check_int
from pagevis.model.chat import IM_END, chatml_segments

WORKLOADS = {
    "chat": "chat with a shared system prompt: every request opens with the same passage, then asks its own "
            "question (the prefix cache computes the passage once)",
    "returning": "returning users: each user comes back after a pause; the next prompt is the whole previous "
                 "turn (prompt and answer) plus a new message",
    "documents": "long documents: every request a different long passage to summarise; a small pool runs out "
                 "of pages and preempts the newest request",
}
TEXT = "pride-and-prejudice-ch1-6.txt"
QUESTIONS = ("Explain in simple words: “{}”", "Who says or thinks this, and why? “{}”",
             "What does this tell us about the Bennet family? “{}”", "Put this in modern English: “{}”")
MAX_RATE = 6000.0  # arrivals per minute


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "chat"
    rate_per_min: float = 30.0  # first-turn arrivals per minute of server time (Poisson)
    n_requests: int = 40  # first turns (users)
    seed: int = 0
    max_new_tokens: int = 48  # each request draws its limit from [max_new_tokens // 2, max_new_tokens]
    ignore_eos: bool = False  # decode every request to its limit (fixed shapes, for benches)
    system_words: int = 220  # chat: words of the shared passage
    question_words: int = 24  # chat: at most this many words of the quoted sentence
    document_words: int = 420  # documents: words per passage
    message_words: int = 40  # returning: words per user message
    turns: int = 3  # returning: turns per user
    think_seconds: float = 3.0  # returning: mean pause before the next turn

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ConfigError("workload", self.kind, "one of " + ", ".join(WORKLOADS))
        if not (isinstance(self.rate_per_min, (int, float)) and 0 < self.rate_per_min <= MAX_RATE):
            raise ConfigError("rate_per_min", self.rate_per_min, f"a number in (0, {MAX_RATE:g}]")
        check_int("n_requests", self.n_requests, 1, 100_000)
        check_int("seed", self.seed, 0, 2**32 - 1)
        check_int("max_new_tokens", self.max_new_tokens, 1, 100_000)
        for name in ("system_words", "question_words", "document_words", "message_words"):
            check_int(name, getattr(self, name), 1, 100_000)
        check_int("turns", self.turns, 1, 100)
        if not (isinstance(self.think_seconds, (int, float)) and 0 <= self.think_seconds <= 3600):
            raise ConfigError("think_seconds", self.think_seconds, "a number of seconds in [0, 3600]")


@dataclass(frozen=True)
class Arrival:
    """One request as the client sends it. `id` numbers requests in arrival order of first turns (follow-up
    turns: see `follow_up_id`); it is the same on both sides of an A/B."""

    id: int
    time: float  # server seconds
    user: int
    turn: int  # 1 for a first turn
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int  # the request's sampling seed
    text: str  # the new message, for the request list (the prompt may hold earlier turns too)


def first_turn(system: str, question: str) -> list[dict]:
    """A chat request's messages: a system prompt and the user's question."""
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def returning_turn(previous: list[dict], answer: str, follow_up: str) -> list[dict]:
    """The user's next request: the previous messages, the answer they streamed, and a new message."""
    return [*previous, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]


class PoissonGaps:
    """The gaps between arrivals of a Poisson process: seeded unit exponentials, each scaled by the rate given
    when it is drawn."""

    def __init__(self, seed: int) -> None:
        self._unit = np.random.default_rng([seed, 1])

    def gap(self, rate_per_min: float) -> float:
        """Seconds to the next arrival at `rate_per_min` arrivals per minute."""
        return float(self._unit.exponential()) * 60.0 / rate_per_min


def follow_up_id(n_users: int, user: int, turn: int) -> int:
    """Ids of follow-up turns come after every first turn's: user u's turn t (t >= 2)."""
    return n_users + (turn - 2) * n_users + user


@lru_cache(maxsize=1)
def _book() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(words, sentences, paragraphs) of the shipped text."""
    text = resources.files("pagevis.resources").joinpath(f"texts/{TEXT}").read_text("utf-8")
    paragraphs = tuple(" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= 12)
    flat = " ".join(paragraphs)
    pieces = (s.strip("\"“” ") for s in re.split(r"(?<=[.!?])[”\"]?\s+", flat))
    sentences = tuple(s for s in pieces if 6 <= len(s.split()) <= 60)
    return tuple(flat.split()), sentences, paragraphs


class ArrivalSchedule:
    """The first turns, generated in order as the sides ask for them, and the follow-up turns' contents."""

    def __init__(self, config: WorkloadConfig, model):
        self.config = config
        self.tokenizer = tokenizer = model.tokenizer
        self.eos_ids = tuple(model.config.eos_ids)
        self.rate_per_min = float(config.rate_per_min)
        self.arrivals: list[Arrival] = []
        self._gaps = PoissonGaps(config.seed)
        self._bos = len(tokenizer.encode(""))  # ids a plain encode puts first (a BOS), dropped from pieces
        words, _, _ = _book()
        self._system = ("You answer questions about this passage from Pride and Prejudice.\n\n"
                        + " ".join(words[: config.system_words]))

    def set_rate(self, rate_per_min: float) -> None:
        """Arrivals not generated yet come at this rate."""
        if not 0 < rate_per_min <= MAX_RATE:
            raise ConfigError("rate_per_min", rate_per_min, f"a number in (0, {MAX_RATE:g}]")
        self.rate_per_min = float(rate_per_min)

    def get(self, index: int) -> Arrival | None:
        """First turn number `index` (generated now if needed), or None past the last."""
        if index >= self.config.n_requests:
            return None
        while len(self.arrivals) <= index:
            previous = self.arrivals[-1].time if self.arrivals else 0.0
            gap = self._gaps.gap(self.rate_per_min)
            self.arrivals.append(self._first_turn(len(self.arrivals), previous + gap))
        return self.arrivals[index]

    # --- contents ----------------------------------------------------------------------------------------
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, *key])

    def _limit(self, rng: np.random.Generator) -> int:
        top = self.config.max_new_tokens
        return int(rng.integers(max(1, top // 2), top + 1))

    def _first_turn(self, index: int, time: float) -> Arrival:
        cfg, rng = self.config, self._rng(2, index)
        words, sentences, paragraphs = _book()
        if cfg.kind == "chat":
            sentence = " ".join(sentences[int(rng.integers(len(sentences)))].split()[: cfg.question_words])
            text = QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(sentence)
            messages = first_turn(self._system, text)
        elif cfg.kind == "documents":
            start = int(rng.integers(0, max(1, len(words) - cfg.document_words)))
            passage = " ".join(words[start: start + cfg.document_words])
            text = f"Summarise this passage in two sentences:\n\n{passage}"
            messages = [{"role": "user", "content": text}]
        else:
            text = self._message(index, 1)
            messages = [{"role": "user", "content": text}]
        prompt = tuple(int(t) for t in self.tokenizer.encode_chat(messages))
        return Arrival(index, time, index, 1, prompt, self._limit(rng), cfg.seed + index, text)

    def _message(self, user: int, turn: int) -> str:
        _, _, paragraphs = _book()
        paragraph = paragraphs[(user * 7 + turn * 3) % len(paragraphs)]
        head = " ".join(paragraph.split()[: self.config.message_words])
        return f"{head}\n\nWhat happens next?" if turn == 1 else f"And then? {head}"

    def follow_up(self, previous: Arrival, tokens, ended_at: float) -> Arrival | None:
        """The user's next turn after `previous` ended at `ended_at` with these tokens (prompt and answer, as
        the engine holds them), or None after the last turn (and for workloads without follow-ups)."""
        cfg = self.config
        if cfg.kind != "returning" or previous.turn >= cfg.turns:
            return None
        turn = previous.turn + 1
        rng = self._rng(3, previous.user, turn)
        think = float(rng.exponential(cfg.think_seconds)) if cfg.think_seconds else 0.0
        text = self._message(previous.user, turn)
        ids = [int(t) for t in tokens]
        segments = chatml_segments([{"role": "user", "content": text}], default_system=None)
        if not ids or ids[-1] not in self.eos_ids:  # the answer did not end its turn itself: the template closes it
            segments = [(IM_END, True), ("\n", False), *segments]
        else:
            segments = [("\n", False), *segments]
        for piece, control in segments:
            ids += self.tokenizer.encode(piece, special=control)[self._bos:]
        index = follow_up_id(cfg.n_requests, previous.user, turn)
        return Arrival(index, ended_at + think, previous.user, turn, tuple(ids), self._limit(rng), cfg.seed + index,
                       text)

"""Stop strings on streamed text, in time linear in the text (the engine ends a request at one; the server
holds back streamed text that may be the start of one): one Knuth-Morris-Pratt automaton per stop string
(its state: how much of the stop string the text now ends with). Each character moves every automaton; the
failure links it follows are paid for by the characters that advanced it, so a request's whole output costs
at most 2 x (number of stop strings) transitions per character, whatever the stop strings' lengths. What is
held back is only the longest partial match (shorter than the longest stop string).

The stop strings of one request are capped in number and in total length (MAX_STOPS, MAX_STOP_CHARS): the
automata's tables are built once per request, in time linear in that total.
"""

from __future__ import annotations

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 4096  # all of a request's stop strings together


def stop_problem(stops: list[str]) -> str | None:
    """Why these stop strings are refused (the request's `stop` field), or None."""
    if len(stops) > MAX_STOPS:
        return f"{len(stops)} stop strings; at most {MAX_STOPS}"
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS:
        return f"{total} characters of stop strings; at most {MAX_STOP_CHARS} in all"
    return None


def _failure(stop: str) -> list[int]:
    """KMP's prefix function: for each prefix, the length of its longest proper border."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Streams text while watching for stop strings: text that could be the start of one is held back until it
    is clearly not; at the first stop string to complete, everything from its start on is dropped.
    `work` counts automaton transitions (the matcher's cost, for tests)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.pending = ""
        self.work = 0

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string completed)."""
        if not self.stops:
            return text, False
        buffer = self.pending + text
        base = len(self.pending)
        for offset, char in enumerate(text):
            matched = self._step(char)
            if matched:
                end = base + offset + 1
                self.pending = ""
                return buffer[: end - matched], True
        held = max(self._state)
        cut = len(buffer) - held
        out, self.pending = buffer[:cut], buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _step(self, char: str) -> int:
        """Advance every automaton by one character; the length of the longest stop string completed, else 0."""
        matched = 0
        for i, stop in enumerate(self.stops):
            state, fail = self._state[i], self._fail[i]
            if state == len(stop):
                state = fail[state - 1]
            while state and stop[state] != char:
                state = fail[state - 1]
                self.work += 1
            if stop[state] == char:
                state += 1
            self.work += 1
            self._state[i] = state
            if state == len(stop):
                matched = max(matched, state)
        return matched

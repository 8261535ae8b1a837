"""One request's token times: its time to first token (from its arrival) and the gap before each later token
(inter-token latency). The one tracker of every place that measures them: a server engine's metrics
(observe.py), the simulated server (simserver/run.py) and the serving bench's clients (bench/serving.py).
Three floats per request; nothing grows with tokens."""

from __future__ import annotations


class TokenTimes:
    """Times in whatever clock the caller reads (time.monotonic, a server clock, seconds since a send)."""

    __slots__ = ("arrival", "first_token", "last_token")

    def __init__(self, arrival: float = 0.0) -> None:
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None

    def token(self, now: float) -> tuple[bool, float]:
        """A token came at `now`: (True, its time to first token) for the first, else (False, the gap since
        the token before it)."""
        previous = self.last_token
        self.last_token = now
        if previous is None:
            self.first_token = now
            return True, now - self.arrival
        return False, now - previous

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def shift(self, seconds: float) -> None:
        """Move every time later by `seconds` (a pause that must not count)."""
        self.arrival += seconds
        if self.first_token is not None:
            self.first_token += seconds
        if self.last_token is not None:
            self.last_token += seconds

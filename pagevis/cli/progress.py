"""A one-line progress bar on stderr, drawn only when stderr is a terminal (logs stay clean)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", enabled: bool | None = None, stream=None, width: int = 30):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.started = time.perf_counter()
        self._last_draw = 0.0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.started
        left = f" ~{_clock(elapsed * (self.total - done) / done)} left" if 0 < done < self.total else ""
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {_clock(elapsed)}{left} {note}\033[K")
        self.stream.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"

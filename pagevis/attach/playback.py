"""A recording (recording.py) played back through the same feeds as a live stream, to any position.

`Playback(recording, limits=None)`: `len()` live messages; `position`; `advance(count=1)`; `seek(index)` (back:
rebuilt from the start); `fleet` is the state at `position` (snapshot it as live). Each replay request a live
feed made was recorded as a 0-frame REPLAY record followed by the replies; playing asks the same questions in
the same order, so each request gets the replies recorded for it. Recordings without request markers (the
fixtures) split replies at the end marker.
"""

from __future__ import annotations

from pagevis.attach.feed import END_SEQ, EndpointFeed, Replayed, parse_replay_reply
from pagevis.attach.events import DecodeError
from pagevis.attach.recording import LIVE, Recording
from pagevis.attach.state import Fleet, StateLimits


class Playback:
    def __init__(self, recording: Recording, limits: StateLimits | None = None):
        self.recording = recording
        self.limits = limits
        self._live = [r for r in recording.records if r.kind == LIVE]
        self._groups = _replay_groups(recording)
        meta = recording.meta
        self._replays = meta.get("replays") if isinstance(meta.get("replays"), list) else []
        topic = meta.get("topic")
        self._topic = topic.encode() if isinstance(topic, str) else None
        self._reset()

    def __len__(self) -> int:
        return len(self._live)

    def _reset(self) -> None:
        self.fleet = Fleet(self.limits or StateLimits())
        self._cursor = [0] * len(self.recording.endpoints)
        self.feeds = []
        for index, name in enumerate(self.recording.endpoints):
            has_replay = bool(self._groups[index]) or (index < len(self._replays) and self._replays[index])
            self.feeds.append(EndpointFeed(self.fleet.add(name), self._replay_fn(index) if has_replay else None,
                                           self._topic, self.fleet.lock))
        self.position = 0
        for index, feed in enumerate(self.feeds):
            if index < len(self._replays) and self._replays[index]:
                feed.start()

    def _replay_fn(self, index: int):
        def replay(start: int) -> Replayed:
            groups, at = self._groups[index], self._cursor[index]
            if at >= len(groups):
                return Replayed((), False)
            self._cursor[index] += 1
            return groups[at]
        return replay

    def live_frames(self, index: int) -> tuple[bytes, ...] | None:
        """The frames of live message `index` (None past the end): what a caller peeks at before playing it."""
        return self._live[index].frames if 0 <= index < len(self._live) else None

    def advance(self, count: int = 1) -> int:
        """Play up to `count` more live messages; returns how many were played."""
        played = 0
        while played < count and self.position < len(self._live):
            record = self._live[self.position]
            self.feeds[record.endpoint].on_live(record.frames)
            self.position += 1
            played += 1
        return played

    def seek(self, index: int) -> None:
        index = max(0, min(index, len(self._live)))
        if index < self.position:
            self._reset()
        self.advance(index - self.position)


def _replay_groups(recording: Recording) -> list[list[Replayed]]:
    groups: list[list[Replayed]] = [[] for _ in recording.endpoints]
    current: dict[int, list] = {}

    def close(endpoint: int, complete: bool) -> None:
        if endpoint in current:
            groups[endpoint].append(Replayed(tuple(current.pop(endpoint)), complete))

    for record in recording.records:
        if record.kind == LIVE:
            continue
        if not record.frames:  # a request began
            close(record.endpoint, False)
            current[record.endpoint] = []
            continue
        try:
            seq, payload = parse_replay_reply(record.frames)
        except DecodeError:
            continue
        current.setdefault(record.endpoint, [])
        if seq == END_SEQ:
            close(record.endpoint, True)
        else:
            current[record.endpoint].append((seq, payload))
    for endpoint in list(current):
        close(endpoint, False)
    return groups

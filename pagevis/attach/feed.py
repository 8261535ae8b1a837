"""One endpoint's messages, in seq order, into its EngineState: frames checked, duplicates dropped, gaps filled
from the replay endpoint, a restart (seq going back) turned into a new epoch. No sockets: the replay is a
callable, so the same code runs live (subscriber.py), from a recording (playback.py) and in tests.

Rules, for a live message with sequence number `seq` (`last` = the last seq applied in this epoch):
- `seq` ≤ the previous live seq: the engine restarted (vLLM counts from 0 again) → new epoch, then as below;
  except the very same message again (same seq, same bytes), a duplicate.
- `seq` ≤ `last`: already applied from a replay → a duplicate, dropped.
- first message of an epoch with `seq` > 0, or `seq` > `last` + 1: the seqs in between are asked for from the
  replay endpoint and applied first; the ones it no longer has are counted (`note_gap`). At the start of an
  epoch the missing ones are history from before the attach, reported by `note_history`, not a gap.
Replay replies are (topic, seq, payload) since vLLM 0.26 and in SGLang, (seq, payload) before; both are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from pagevis.attach.events import DecodeError, decode_payload
from pagevis.attach.state import EngineState

END_SEQ = -1
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True)
class Replayed:
    """What a replay request returned: (seq, payload) pairs in order; `complete` if the end marker came."""

    batches: tuple[tuple[int, bytes], ...]
    complete: bool


ReplayFn = Callable[[int], "Replayed | None"]  # start seq -> replies, or None without a replay endpoint


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError("seq", f"a seq frame is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def parse_live(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a PUB message; DecodeError if it is not three frames with an 8-byte seq."""
    if len(frames) != 3:
        raise DecodeError("frames", f"a message is 3 frames (topic, seq, payload), not {len(frames)}")
    seq = parse_seq(frames[1])
    if seq < 0:
        raise DecodeError("seq", f"negative seq {seq}")
    return bytes(frames[0]), seq, bytes(frames[2])


def parse_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one replay reply (the DEALER's empty delimiter already dropped); seq END_SEQ ends it."""
    if len(frames) == 3:  # vLLM >= 0.26, SGLang: topic, seq, payload
        frames = frames[1:]
    if len(frames) != 2:
        raise DecodeError("frames", f"a replay reply is 2 or 3 frames, not {len(frames)}")
    seq = parse_seq(frames[0])
    if seq < END_SEQ:
        raise DecodeError("seq", f"negative seq {seq} in a replay")
    return seq, bytes(frames[1])


class EndpointFeed:
    """Feeds one endpoint's frames to `state` (see the module docstring)."""

    def __init__(self, state: EngineState, replay: ReplayFn | None = None, topic: bytes | None = None,
                 lock=None):
        self.state = state
        self._replay = replay
        self._topic = topic
        self._lock = lock
        self._last_live: int | None = None
        self._last_payload = b""
        self.other_topic = 0

    @property
    def has_replay(self) -> bool:
        return self._replay is not None

    def start(self) -> None:
        """On attach: rebuild what the engine holds from its replay buffer (if there is a replay endpoint)."""
        if self._replay is not None and self.state.last_seq is None:
            self._fill(0, None)

    def on_live(self, frames: Sequence[bytes]) -> None:
        try:
            topic, seq, payload = parse_live(frames)
        except DecodeError as error:
            self._error(error)
            return
        if self._topic is not None and topic != self._topic:
            self.other_topic += 1  # ZMQ subscribes by prefix: "kv-events-2" reaches a "kv-events" subscriber
            return
        if self._last_live is not None and seq <= self._last_live:
            if seq == self._last_live and payload == self._last_payload:
                self.state.note_duplicate()  # the same message again (ZMQ does not do that; a relay might)
                return
            self._locked(self.state.start_epoch)
        self._last_live, self._last_payload = seq, payload
        last = self.state.last_seq
        if last is not None and seq <= last:
            self.state.note_duplicate()
            return
        expected = 0 if last is None else last + 1
        if seq > expected:
            self._fill(expected, seq)
            last = self.state.last_seq
            if last is not None and seq <= last:
                self.state.note_duplicate()  # the replay had it too
                return
        self._apply(seq, payload, replayed=False)

    def _fill(self, start: int, until: int | None) -> None:
        """Ask the replay endpoint for seqs from `start` and apply the ones not applied yet. `until` is the live
        seq waiting (None at attach); the seqs before it that nothing supplied are counted."""
        at_epoch_start = self.state.last_seq is None
        replies = self._replay(start) if self._replay is not None else None
        first_replayed, applied, holes = None, 0, 0
        for seq, payload in replies.batches if replies is not None else ():
            last = self.state.last_seq
            if last is not None and seq <= last:
                continue  # out of order, or already applied
            if last is not None and seq > last + 1:
                holes += seq - last - 1  # the buffer did not have them
            first_replayed = seq if first_replayed is None else first_replayed
            self._apply(seq, payload, replayed=True)
            applied += 1
        last = self.state.last_seq
        tail = 0  # seqs before the waiting live one that nothing supplied
        if until is not None and (last is None or last < until - 1):
            tail = until - 1 - (start - 1 if last is None else last)
        if at_epoch_start:
            if first_replayed is not None:
                before: int | None = first_replayed
            elif until is not None:
                before = until
            else:  # nothing yet: an empty buffer means nothing was published; no answer means nothing is known
                before = 0 if replies is not None and replies.complete else None
            inside = holes + (tail if first_replayed is not None else 0)
            self._locked(lambda: self.state.note_history(first_replayed, applied, before, inside))
        elif until is not None:
            self._locked(lambda: self.state.note_gap(holes + tail, recovered=holes + tail == 0))

    def _apply(self, seq: int, payload: bytes, replayed: bool) -> None:
        try:
            batch = decode_payload(payload)
        except DecodeError as error:
            self._error(error)
            batch = None
        if self._lock is not None:
            with self._lock:
                self._apply_decoded(seq, batch, replayed)
        else:
            self._apply_decoded(seq, batch, replayed)

    def _apply_decoded(self, seq: int, batch, replayed: bool) -> None:
        if batch is None:
            self.state.skip_seq(seq)  # a payload that will never decode: its seq is spent, not a gap
        else:
            self.state.apply_batch(seq, batch, replayed=replayed)

    def _error(self, error: DecodeError) -> None:
        self._locked(lambda: self.state.note_decode_error(error.reason, error.detail))

    def _locked(self, action: Callable[[], None]) -> None:
        if self._lock is not None:
            with self._lock:
                action()
        else:
            action()

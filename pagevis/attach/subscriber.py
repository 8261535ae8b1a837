"""ZMQ: a SUB socket per engine endpoint, a DEALER per replay request, one poll loop for all of them.

`Attacher(sources, limits=None, recorder=None)` builds a `Fleet` (state.py) with one `EngineState` and one
`EndpointFeed` (feed.py) per `Source`; `start()` connects and rebuilds each engine's state from its replay
buffer; `poll(timeout_s)` handles every message waiting (returns how many); `run(duration, idle_exit, stop)`
loops until one of them says stop; `close()`. All state changes happen under `fleet.lock`, so a window can call
`fleet.snapshot()` from its own thread while `run` goes on in a worker thread.

Endpoints: "tcp://HOST:PORT" or "tcp://HOST:PORT,tcp://HOST:REPLAYPORT" (ipc:// too). `expand_dp(source, n)` makes
the data-parallel ranks: rank r publishes on port + r (and replays on replay port + r), as vLLM and SGLang do.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from pagevis.attach.events import MAX_PAYLOAD_BYTES, DecodeError
from pagevis.attach.feed import END_SEQ, EndpointFeed, Replayed, parse_replay_reply
from pagevis.attach.recording import LIVE, REPLAY, Recorder
from pagevis.attach.state import Fleet, StateLimits

RCV_HWM = 100_000  # messages a SUB socket queues while a replay runs (vLLM's PUB hwm)
REPLAY_IDLE_S = 2.0  # a replay that sends nothing for this long is over (partial)
REPLAY_MAX_S = 30.0
REPLAY_MAX_BATCHES = 200_000  # more than vLLM's default buffer (10,000 steps) by far


@dataclass(frozen=True)
class Source:
    endpoint: str
    replay: str | None = None
    topic: str = ""


def parse_source(text: str, topic: str = "") -> Source:
    """"ENDPOINT" or "ENDPOINT,REPLAY"; ValueError with a sentence otherwise."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"{text!r}: give ENDPOINT or ENDPOINT,REPLAY_ENDPOINT")
    for part in parts:
        if not part.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{part!r}: an endpoint starts with tcp://, ipc:// or inproc://")
        if part.startswith("tcp://") and "*" in part:
            raise ValueError(f"{part!r}: connect to the engine's host (tcp://HOST:5557), not a wildcard")
    return Source(parts[0], parts[1] if len(parts) == 2 else None, topic)


def offset_port(endpoint: str, rank: int) -> str:
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r}: --dp-size needs tcp:// endpoints (rank r uses port + r)")
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not 0 < int(port) + rank <= 65535:
        raise ValueError(f"{endpoint!r}: no port to offset by rank {rank}")
    return f"{host}:{int(port) + rank}"


def expand_dp(source: Source, size: int) -> list[Source]:
    return [Source(offset_port(source.endpoint, r), offset_port(source.replay, r) if source.replay else None,
                   source.topic) for r in range(size)]


class ReplayClient:
    """Asks one ROUTER replay endpoint for the batches from a seq. A fresh DEALER per request, closed after it,
    so a late answer to an abandoned request can never be read as the answer to the next one."""

    def __init__(self, ctx: zmq.Context, endpoint: str, on_frames=None):
        self.ctx, self.endpoint, self._on_frames = ctx, endpoint, on_frames
        self.errors: list[DecodeError] = []

    def __call__(self, start: int) -> Replayed:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        dealer.setsockopt(zmq.RCVHWM, 0)
        batches: list[tuple[int, bytes]] = []
        complete = False
        if self._on_frames is not None:
            self._on_frames(())  # a recording marks where each request began (playback.py)
        try:
            dealer.connect(self.endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            began = time.monotonic()
            while len(batches) < REPLAY_MAX_BATCHES and time.monotonic() - began < REPLAY_MAX_S:
                if not dealer.poll(int(REPLAY_IDLE_S * 1000)):
                    break
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the DEALER's empty delimiter
                if self._on_frames is not None:
                    self._on_frames(frames)
                try:
                    seq, payload = parse_replay_reply(frames)
                except DecodeError as error:
                    self.errors.append(error)
                    continue
                if seq == END_SEQ:
                    complete = True
                    break
                batches.append((seq, payload))
        finally:
            dealer.close(linger=0)
        return Replayed(tuple(batches), complete)


class Attacher:
    """Subscribes to every source and keeps `fleet` up to date (see the module docstring)."""

    def __init__(self, sources: list[Source], limits: StateLimits | None = None, recorder: Recorder | None = None,
                 ctx: zmq.Context | None = None):
        self.sources = list(sources)
        self.fleet = Fleet(limits or StateLimits())
        self.ctx = ctx or zmq.Context.instance()
        self._recorder = recorder
        self._sockets: list[zmq.Socket] = []
        self._poller = zmq.Poller()
        self.feeds: list[EndpointFeed] = []
        self._replays: list[ReplayClient | None] = []
        self.last_message = time.monotonic()

    def start(self) -> None:
        for index, source in enumerate(self.sources):
            state = self.fleet.add(source.endpoint)
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCV_HWM)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            sub.connect(source.endpoint)
            self._sockets.append(sub)
            self._poller.register(sub, zmq.POLLIN)
            replay = None
            if source.replay:
                replay = ReplayClient(self.ctx, source.replay, self._recording(REPLAY, index))
            self._replays.append(replay)
            topic = source.topic.encode() if source.topic else None  # "": every topic, as a SUB prefix
            self.feeds.append(EndpointFeed(state, self._replay_fn(index), topic, self.fleet.lock))
        for feed in self.feeds:
            feed.start()
            self._count_replay_errors()

    def _replay_fn(self, index: int):
        client = self._replays[index]
        if client is None:
            return None

        def replay(start: int) -> Replayed:
            replies = client(start)
            self._count_replay_errors()
            return replies
        return replay

    def _count_replay_errors(self) -> None:
        for feed, client in zip(self.feeds, self._replays):
            if client is not None and client.errors:
                with self.fleet.lock:
                    for error in client.errors:
                        feed.state.note_decode_error(error.reason, f"replay: {error.detail}")
                client.errors.clear()

    def _recording(self, kind: int, index: int):
        if self._recorder is None:
            return None
        return lambda frames: self._recorder.write(kind, index, time.monotonic(), frames)

    def poll(self, timeout_s: float) -> int:
        """Handle the messages waiting (waiting up to `timeout_s` for the first); returns how many."""
        handled = 0
        events = dict(self._poller.poll(int(max(0.0, timeout_s) * 1000)))
        while events:
            for index, sub in enumerate(self._sockets):
                if sub not in events:
                    continue
                for _ in range(1000):  # then give the other endpoints a turn
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._recorder is not None:
                        self._recorder.write(LIVE, index, time.monotonic(), frames)
                    self.feeds[index].on_live(frames)
                    handled += 1
            events = dict(self._poller.poll(0))
        if handled:
            self.last_message = time.monotonic()
        return handled

    def run(self, duration: float | None = None, idle_exit: float | None = None,
            stop: threading.Event | None = None) -> None:
        """Poll until `duration` seconds passed, or `idle_exit` seconds without a message, or `stop` is set."""
        began = time.monotonic()
        self.last_message = began
        while not (stop is not None and stop.is_set()):
            now = time.monotonic()
            if duration is not None and now - began >= duration:
                break
            if idle_exit is not None and now - self.last_message >= idle_exit:
                break
            wait = 0.1
            if duration is not None:
                wait = min(wait, began + duration - now)
            self.poll(wait)

    def close(self) -> None:
        for sub in self._sockets:
            sub.close(linger=0)
        self._sockets.clear()
        if self._recorder is not None:
            self._recorder.flush()

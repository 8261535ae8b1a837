"""Publishing KV events the way vLLM ≥ 0.26 does: (topic, seq, payload) on a PUB socket, and a ROUTER replay
endpoint answering a start seq with every buffered batch from it, then the end marker (b"", -1, b"").

`KVEventPublisher(endpoint, replay_endpoint=None, topic="", buffer_steps=10_000, data_parallel_rank=0)`
- `publish(events, ts=None)` → seq: encodes with `encode_batch`, sends, keeps the payload for replay.
- `close()`.
The replay endpoint is served on a daemon thread (the ROUTER socket lives there; the buffer is shared under a
lock). Endpoints with "*" or ipc:// bind, others connect, as in vLLM (`bind=True` binds a concrete address, as
SGLang's option does). Used by the tests and meant for
`pagevis serve --kv-events-endpoint`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from pagevis.errors import ConfigError

from pagevis.attach.events import encode_batch, seq_bytes

END_MARKER = (b"", seq_bytes(-1), b"")


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open(socket, endpoint: str, bind: bool, field: str) -> None:
    """Bind or connect, or a ConfigError naming the endpoint (a mistyped one is the user's to fix)."""
    allowed = "a ZMQ endpoint this process can " + ("bind (tcp://HOST:PORT, tcp://*:PORT, ipc://PATH)" if bind
                                                    else "connect (tcp://HOST:PORT, ipc://PATH)")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        wildcard = bind and port == "*"
        if not wildcard and not (port.isdigit() and 1 <= int(port) <= 65535):
            # ZMQ itself takes port 99999 as 99999 mod 65536 and binds 34463
            socket.close(linger=0)
            raise ConfigError(field, endpoint, f"{allowed} with a port from 1 to 65535"
                              f"{' or *' if bind else ''}")
    try:
        (socket.bind if bind else socket.connect)(endpoint)
    except zmq.ZMQError as error:
        socket.close(linger=0)
        raise ConfigError(field, endpoint, f"{allowed}: {error.strerror}") from None


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, data_parallel_rank: int | None = 0, ctx: zmq.Context | None = None,
                 bind: bool | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        bind = binds(endpoint) if bind is None else bind
        _open(self._pub, endpoint, bind, "kv_events_endpoint")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint
        self._running = True
        self._thread = None
        self.replay_endpoint = None
        if replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            try:
                _open(router, replay_endpoint, True, "kv_events_replay")
            except ConfigError:
                router.close(linger=0)
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True,
                                            name="kv-event-replay")
            self._thread.start()

    def publish(self, events: list, ts: float | None = None, send: bool = True) -> int:
        """Publish one batch; returns its seq. `send=False` only buffers it for replay (a message the network
        lost: for tests)."""
        payload = encode_batch(time.time() if ts is None else ts, events, self.rank)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
        return seq

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while self._running:
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    batches = [item for item in self._buffer if item[0] >= start_seq]
                for seq, payload in batches:
                    router.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
                router.send_multipart((client, b"") + END_MARKER)
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(linger=0)

"""Real ZMQ sockets on loopback: late attach from the replay buffer, a lost message filled by replay, an engine
restart (a new epoch), hostile frames among good ones. Every wait is bounded."""

import time

import msgspec
import pytest
import zmq

from pagevis.attach import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from pagevis.attach.publisher import KVEventPublisher
from pagevis.errors import ConfigError
from pagevis.attach.subscriber import Attacher, Source, expand_dp, parse_source

TOPIC = "kv-events"


def stored(hashes, parent=None, size=2):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, block_size=size, medium="GPU",
                       token_ids=[h * 10 + i for h in hashes for i in range(size)])


def removed(hashes):
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def until(attacher, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        attacher.poll(0.05)
    return condition()


@pytest.fixture
def publisher():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
    yield pub
    pub.close()


def wait_subscribed(attacher, pub_socket, timeout=10.0):
    """Probe until the SUB socket's subscription has reached the PUB socket: a topic that starts with TOPIC gets
    through ZMQ's prefix filter, and the feed ignores it (it counts it in other_topic)."""
    feed = attacher.feeds[0]
    deadline = time.monotonic() + timeout
    while feed.other_topic == 0 and time.monotonic() < deadline:
        pub_socket.send_multipart([f"{TOPIC}-probe".encode(), b"\0" * 8, b""])
        attacher.poll(0.05)
    assert feed.other_topic > 0, "the subscription never arrived"


def attach(pub, replay=True):
    attacher = Attacher([Source(pub.endpoint, pub.replay_endpoint if replay else None, TOPIC)])
    attacher.start()
    wait_subscribed(attacher, pub._pub)
    return attacher


def test_late_attach_rebuilds_from_the_replay_buffer_then_follows_live(publisher):
    publisher.publish([stored([1, 2, 3])], ts=1.0)
    publisher.publish([stored([4], parent=3)], ts=2.0)
    publisher.publish([removed([2])], ts=3.0)
    attacher = attach(publisher)
    try:
        state = attacher.fleet.engines[0]
        c = state.counters()
        assert (c.history_from_seq, c.history_batches, c.history_missing, c.replayed_batches) == (0, 3, 0, 3)
        assert sorted(h for h in state.snapshot().blocks.hashes if h is not None) == [1, 3, 4]
        publisher.publish([stored([5], parent=4)], ts=4.0)
        assert until(attacher, lambda: state.last_seq == 3)
        assert state.children(4) == [5] and state.counters().batches == 4
    finally:
        attacher.close()


def test_a_lost_message_is_filled_from_replay(publisher):
    attacher = attach(publisher)
    try:
        state = attacher.fleet.engines[0]
        publisher.publish([stored([1, 2])], ts=1.0)
        assert until(attacher, lambda: state.last_seq == 0)
        publisher.publish([stored([3], parent=2)], ts=2.0, send=False)  # lost on the way
        publisher.publish([removed([1])], ts=3.0)
        assert until(attacher, lambda: state.last_seq == 2)
        c = state.counters()
        # the replay sends seqs 1 and 2; the live seq 2 waiting is then a duplicate
        assert (c.gaps, c.gaps_unrecovered, c.replayed_batches, c.batches, c.duplicates) == (1, 0, 2, 3, 1)
        assert state.block(3) is not None and state.block(1) is None
    finally:
        attacher.close()


def test_a_gap_without_replay_is_counted_unrecovered(publisher):
    attacher = attach(publisher, replay=False)
    try:
        state = attacher.fleet.engines[0]
        publisher.publish([stored([1])], ts=1.0)
        assert until(attacher, lambda: state.last_seq == 0)
        publisher.publish([stored([2])], ts=2.0, send=False)
        publisher.publish([stored([3])], ts=3.0, send=False)
        publisher.publish([stored([4])], ts=4.0)
        assert until(attacher, lambda: state.last_seq == 3)
        c = state.counters()
        assert (c.gaps, c.gaps_unrecovered, c.missing_batches, c.batches) == (1, 1, 2, 2)
    finally:
        attacher.close()


def test_an_engine_restart_starts_a_new_epoch():
    first = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
    endpoint, replay = first.endpoint, first.replay_endpoint
    attacher = attach(first)
    state = attacher.fleet.engines[0]
    try:
        for seq in range(3):
            first.publish([stored([10 + seq])], ts=float(seq))
        assert until(attacher, lambda: state.last_seq == 2)
        first.close()
        second = None
        for _ in range(50):  # the same ports, once the closed sockets have let them go (closing is asynchronous)
            try:
                second = KVEventPublisher(endpoint, replay, topic=TOPIC, bind=True)
                break
            except ConfigError:  # 'Address already in use' until then
                time.sleep(0.1)
        assert second is not None
        try:
            sent = []
            for _ in range(30):  # until the SUB socket has reconnected; seqs it missed come from the replay
                sent.append(second.publish([stored([99 + len(sent)])], ts=100.0))
                if until(attacher, lambda: state.epoch == 1 and state.last_seq == sent[-1], timeout=0.3):
                    break
            assert state.epoch == 1 and state.last_seq == sent[-1]
            assert sorted(h for h in state.snapshot().blocks.hashes if h is not None) == [99 + s for s in sent]
            assert state.counters().batches == 3 + len(sent)
        finally:
            second.close()
    finally:
        attacher.close()


def test_hostile_frames_are_counted_and_good_batches_keep_applying():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    attacher = Attacher([Source(f"tcp://127.0.0.1:{port}", None, TOPIC)])
    attacher.start()
    wait_subscribed(attacher, pub)
    state = attacher.fleet.engines[0]
    topic = TOPIC.encode()
    seq = iter(range(100))
    hashes = iter(range(1000, 1100))

    def good(*events):
        pub.send_multipart([topic, next(seq).to_bytes(8, "big"), encode_batch(1.0, list(events))])

    def bad(payload):
        pub.send_multipart([topic, next(seq).to_bytes(8, "big"), payload])

    deep = b"\x91" * 100_000 + b"\x00"
    hostile = [
        lambda: pub.send_multipart([topic, b"\x00" * 8]),  # two frames
        lambda: pub.send_multipart([topic, b"\x00" * 8, b"", b""]),  # four frames
        lambda: pub.send_multipart([topic, b"\x01\x02", encode_batch(1.0, [])]),  # seq not 8 bytes
        lambda: bad(b"\xc1\xc1 not msgpack"),
        lambda: bad(msgspec.msgpack.encode({"ts": 1})),  # a map, not [ts, events, rank]
        lambda: bad(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]])),
        lambda: bad(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [7], "token_ids": [1],
                                                    "block_size": 2, "parent_block_hash": None}]])),  # 1 != 1 x 2
        lambda: bad(b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff"),  # 4 billion events declared
        lambda: bad(b"\x93\xcb" + b"\x00" * 8 + deep),  # deep nesting
        lambda: bad(msgspec.msgpack.encode([float("nan"), []])),
        lambda: bad(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-5],
                                                    "block_size": 1}]])),  # negative token id
    ]
    try:
        good(stored([1, 2]))
        for send in hostile:
            send()
            good(stored([next(hashes)]))
        # an unknown event type among known ones: skipped and counted, the rest of its batch applies
        bad(msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "block_hashes": [1]},
                                          msgspec.to_builtins(removed([1]))], 0]))
        assert until(attacher, lambda: state.counters().decode_errors == len(hostile) + 1 and state.block(1) is None)
        c = state.counters()
        assert c.events["BlockStored"] == 1 + len(hostile) and c.gaps == 0
        assert dict(c.unknown_event_types) == {"BlockPinned": 1}
        assert set(c.decode_errors_by_reason) == {"frames", "seq", "msgpack", "shape", "type", "tokens",
                                                  "unknown_event"}
    finally:
        attacher.close()
        pub.close(linger=0)


def test_sources_and_data_parallel_ranks():
    source = parse_source("tcp://h:5557,tcp://h:6000", TOPIC)
    assert [(s.endpoint, s.replay) for s in expand_dp(source, 3)] == [
        ("tcp://h:5557", "tcp://h:6000"), ("tcp://h:5558", "tcp://h:6001"), ("tcp://h:5559", "tcp://h:6002")]
    for text in ("h:5557", "tcp://*:5557", "tcp://a:1,tcp://b:2,tcp://c:3", "tcp://a:1,"):
        with pytest.raises(ValueError):
            parse_source(text)
    with pytest.raises(ValueError):
        expand_dp(parse_source("ipc:///tmp/x"), 2)


def test_clear_and_counters_in_one_stream(publisher):
    attacher = attach(publisher)
    try:
        state = attacher.fleet.engines[0]
        publisher.publish([stored([1, 2]), AllBlocksCleared(), stored([3])], ts=1.0)
        assert until(attacher, lambda: state.last_seq == 0)
        assert dict(state.counters().events) == {"BlockStored": 2, "BlockRemoved": 0, "AllBlocksCleared": 1}
        assert state.resident_by_medium() == {"GPU": 1}
    finally:
        attacher.close()


def test_snapshots_from_another_thread_are_consistent(publisher):
    import threading

    attacher = attach(publisher)
    stop = threading.Event()
    worker = threading.Thread(target=attacher.run, kwargs={"stop": stop, "duration": 60})
    worker.start()
    try:
        for seq in range(400):
            publisher.publish([stored([seq % 50, 50 + seq % 7], parent=seq % 13), removed([(seq * 7) % 50])],
                              ts=float(seq))
            if seq % 20 == 0:
                snap = attacher.fleet.snapshot().engines[0]
                total = sum(snap.resident.values())
                assert int(snap.blocks.resident.sum()) == total == sum(t.resident for t in snap.tiers)
                assert not len(snap.history.resident) or snap.history.resident[-1] == total
        deadline = time.monotonic() + 10
        while attacher.fleet.engines[0].last_seq != 399 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert attacher.fleet.engines[0].counters().batches == 400
    finally:
        stop.set()
        worker.join(timeout=10)
        attacher.close()
    assert not worker.is_alive()


def test_hostile_replay_replies_are_counted():
    import threading

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve():
        if router.poll(10_000):
            client = router.recv_multipart()[0]
            for reply in ([b"only one frame"], [b"t", b"\x01", b"p"], [b"t", b"\x00" * 8, b"\xc1"],
                          [b"t", (1).to_bytes(8, "big"), encode_batch(1.0, [stored([5])])],
                          [b"", (-1).to_bytes(8, "big", signed=True), b""]):
                router.send_multipart([client, b"", *reply])
    server = threading.Thread(target=serve)
    server.start()
    attacher = Attacher([Source(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", TOPIC)])
    try:
        attacher.start()
        server.join(timeout=15)
        state = attacher.fleet.engines[0]
        c = state.counters()
        assert c.decode_errors == 3 and state.block(5) is not None and c.last_seq == 1
        assert set(c.decode_errors_by_reason) == {"frames", "seq", "msgpack"}
    finally:
        attacher.close()
        router.close(linger=0)
        pub.close(linger=0)

"""The feed's sequencing against a simulated network: live messages dropped and repeated at random, a replay
buffer of limited depth answering with what the engine has published by then. With a deep enough buffer the
state always equals the reference; with any buffer every seq is accounted for exactly once."""

import random

import pytest

from pagevis.attach import BlockRemoved, BlockStored, EngineState, encode_batch
from pagevis.attach.feed import EndpointFeed, Replayed, parse_live, parse_replay_reply
from pagevis.attach.events import DecodeError


def random_stream(rng, count):
    batches, reference = [], {}
    for _ in range(count):
        events = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6:
                h, parent = rng.randrange(40), rng.choice([None, rng.randrange(40)])
                events.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[h, h],
                                          block_size=2, medium="GPU"))
                reference.setdefault(h, parent)
            else:
                h = rng.randrange(40)
                events.append(BlockRemoved(block_hashes=[h], medium="GPU"))
                reference.pop(h, None)
        batches.append(encode_batch(float(len(batches)), events))
    return batches, reference


def frames(seq, payload):
    return [b"t", seq.to_bytes(8, "big"), payload]


def resident(state):
    snap = state.snapshot()
    return {h: p for h, p, r in zip(snap.blocks.hashes, snap.blocks.parents, snap.blocks.resident) if r}


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("depth", [10_000, 3])
def test_drops_and_repeats_with_a_replay_buffer(seed, depth):
    rng = random.Random(seed)
    payloads, reference = random_stream(rng, 60)
    published = [0]  # how many the engine has published when a replay request arrives

    def replay(start):
        newest = published[0]
        oldest = max(0, newest - depth)
        return Replayed(tuple((s, payloads[s]) for s in range(max(start, oldest), newest)), True)

    state = EngineState("e")
    feed = EndpointFeed(state, replay=replay if rng.random() < 0.9 or depth > 3 else None)
    late = rng.randrange(0, 10)  # the engine published these before the attach
    published[0] = late
    feed.start()
    for seq in range(late, len(payloads)):
        published[0] = min(len(payloads), seq + 1 + rng.randrange(3))
        if seq < len(payloads) - 1 and rng.random() < 0.3:
            continue  # lost (never the last one: something must arrive after a loss)
        feed.on_live(frames(seq, payloads[seq]))
        if rng.random() < 0.1:
            feed.on_live(frames(seq, payloads[seq]))  # the network repeats it
    c = state.counters()
    assert c.decode_errors == 0 and c.epoch == 0 and c.last_seq == len(payloads) - 1
    accounted = c.batches + c.missing_batches + (c.history_missing or 0)
    assert accounted == len(payloads)
    if depth > len(payloads) and feed.has_replay:
        assert resident(state) == reference
        assert c.batches == len(payloads) and c.gaps_unrecovered == 0 and c.history_missing == 0


def test_frames_that_are_not_messages():
    for bad in ([b"t", b"\x00" * 8], [b"t", b"\x00" * 7, b""], [b"t", b"\xff" * 8, b""]):
        with pytest.raises(DecodeError):
            parse_live(bad)
    assert parse_replay_reply([b"\x00" * 7 + b"\x05", b"p"]) == (5, b"p")
    assert parse_replay_reply([b"topic", b"\x00" * 7 + b"\x05", b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", b"\xff" * 8, b""])[0] == -1
    for bad in ([b"x"], [b"a", b"b", b"c", b"d"], [b"\x00" * 3, b"p"], [b"\xfe" + b"\xff" * 7, b"p"]):
        with pytest.raises(DecodeError):
            parse_replay_reply(bad)


def test_a_payload_that_never_decodes_spends_its_seq_without_a_gap():
    asked = []
    state = EngineState("e")
    feed = EndpointFeed(state, replay=lambda start: asked.append(start) or Replayed((), True))
    good = encode_batch(0.0, [BlockStored(block_hashes=[1], token_ids=[1], block_size=1)])
    feed.on_live(frames(0, good))
    feed.on_live(frames(1, b"\xc1"))
    feed.on_live(frames(2, good))
    c = state.counters()
    assert (c.batches, c.decode_errors, c.gaps, c.last_seq, asked) == (2, 1, 0, 2, [])


def test_a_restart_seen_late_rebuilds_the_new_epoch_from_replay():
    old, _ = random_stream(random.Random(1), 5)
    new = [encode_batch(100.0 + i, [BlockStored(block_hashes=[100 + i], token_ids=[i], block_size=1)])
           for i in range(4)]
    buffer = [old]
    state = EngineState("e")
    feed = EndpointFeed(state, replay=lambda start: Replayed(
        tuple((s, p) for s, p in enumerate(buffer[0]) if s >= start), True))
    for seq, payload in enumerate(old):
        feed.on_live(frames(seq, payload))
    buffer[0] = new  # the engine restarted; its seqs 0 and 1 were published while we were away
    feed.on_live(frames(2, new[2]))
    feed.on_live(frames(3, new[3]))
    c = state.counters()
    assert (c.epoch, c.last_seq, c.history_from_seq, c.history_batches, c.history_missing) == (1, 3, 0, 4, 0)
    assert resident(state) == {100: None, 101: None, 102: None, 103: None}
    assert c.batches == 5 + 4

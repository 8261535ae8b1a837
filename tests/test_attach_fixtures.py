"""Frames recorded from vLLM's and SGLang's own publisher code (scripts/make_kv_event_fixtures.py) rebuild the
state a plain dict reference computed from the same workload: live, by late attach, and across a gap."""

import json
import pathlib

import pytest

from pagevis.attach import EngineState, Fleet, decode_payload, encode_batch
from pagevis.attach.feed import END_SEQ, EndpointFeed, Replayed, parse_replay_reply
from pagevis.attach.recording import LIVE, REPLAY, read_recording
from pagevis.attach.report import engine_blocks

DATA = pathlib.Path(__file__).parent / "data" / "kv_events"
SOURCES = ["vllm-0.34.0", "vllm-0.25.1", "vllm-0.11.0", "sglang-0.5.23"]


def load(name):
    recording = read_recording(DATA / f"{name}.kvev")
    assert not recording.truncated
    live = [r.frames for r in recording.records if r.kind == LIVE]
    groups, current = [], []
    for record in recording.records:
        if record.kind == REPLAY:
            seq, payload = parse_replay_reply(record.frames)
            if seq == END_SEQ:
                groups.append(Replayed(tuple(current), True))
                current = []
            else:
                current.append((seq, payload))
    expected = json.loads((DATA / f"{name}.expected.json").read_text())
    return recording, live, groups, expected


def as_expected(state):
    got = {}
    for block in engine_blocks(Fleet(engines=[state]).snapshot().engines[0]):
        got.setdefault(block["medium"], []).append({k: block[k] for k in ("hash", "parent", "tokens")})
    return {medium: sorted(rows, key=json.dumps) for medium, rows in got.items()}


def want(expected, key):
    return {medium: sorted(({k: r[k] for k in ("hash", "parent", "tokens")} for r in rows), key=json.dumps)
            for medium, rows in expected[key].items() if rows}


@pytest.mark.parametrize("name", SOURCES)
def test_live_frames_rebuild_the_reference_state(name):
    recording, live, _, expected = load(name)
    state = EngineState("e")
    feed = EndpointFeed(state, topic=b"kv-events")
    for frames in live:
        feed.on_live(frames)
    c = state.counters()
    assert (c.batches, c.last_seq, c.decode_errors, c.gaps) == (7, 6, 0, 0)
    assert c.unknown_removes == 1  # "Z" was never stored
    assert dict(c.events) == {"BlockStored": 8, "BlockRemoved": 5, "AllBlocksCleared": 1}
    assert as_expected(state) == want(expected, "final")
    assert state.snapshot().hot[0].restores == 1  # E came back one step after its removal


def replaying_feed(reply):
    """A feed whose replay endpoint answers `reply` and notes each sequence number it was asked from."""
    asked = []
    state = EngineState("e")
    feed = EndpointFeed(state, replay=lambda start: asked.append(start) or reply, topic=b"kv-events")
    return state, feed, asked


@pytest.mark.parametrize("name", SOURCES)
def test_late_attach_rebuilds_what_the_replay_buffer_still_has(name):
    _, _, groups, expected = load(name)
    state, feed, asked = replaying_feed(groups[0])
    feed.start()
    c = state.counters()
    assert asked == [0]
    assert (c.history_from_seq, c.history_batches, c.history_missing, c.replayed_batches) == (2, 5, 2, 5)
    assert as_expected(state) == want(expected, "from_seq_2")


@pytest.mark.parametrize("name", SOURCES)
def test_a_gap_is_filled_from_the_replay_endpoint(name):
    _, live, groups, expected = load(name)
    state, feed, asked = replaying_feed(groups[1])
    for frames in live[:4] + live[6:]:  # seqs 4 and 5 lost
        feed.on_live(frames)
    c = state.counters()
    assert asked == [4]
    assert (c.gaps, c.gaps_unrecovered, c.missing_batches, c.replayed_batches, c.batches) == (1, 0, 0, 3, 7)
    assert as_expected(state) == want(expected, "final")


@pytest.mark.parametrize("name", SOURCES)
def test_formats_are_told_apart_from_the_bytes(name):
    _, live, groups, _ = load(name)
    recording = read_recording(DATA / f"{name}.kvev")
    replay_frames = {len(r.frames) for r in recording.records if r.kind == REPLAY}
    assert replay_frames == ({2} if name in ("vllm-0.25.1", "vllm-0.11.0") else {3})
    encodings = {decode_payload(frames[2]).encoding for frames in live if decode_payload(frames[2]).events}
    assert encodings == ({"array"} if name == "vllm-0.11.0" else {"map"})


def test_encode_batch_writes_vllm_034_bytes():
    _, live, _, _ = load("vllm-0.34.0")
    for frames in live:
        batch = decode_payload(frames[2])
        assert encode_batch(batch.ts, list(batch.events), batch.data_parallel_rank) == frames[2]


def test_sglang_specifics_survive():
    _, live, _, _ = load("sglang-0.5.23")
    state = EngineState("e")
    feed = EndpointFeed(state)
    for frames in live[:5]:
        feed.on_live(frames)
    assert state.resident_by_medium()["CPU_PINNED"] == 1
    block = next(b for b in engine_blocks(Fleet(engines=[state]).snapshot().engines[0]) if b["medium"] == "GPU")
    assert block["hash"] < 0 or True  # int64 hashes may be negative
    snap = state.snapshot()
    extras = [e for e in snap.blocks.extras if e]
    assert extras and all(e.get("cache_salt") == "salt-1" for e in extras)

"""EngineState against a brute-force reference (a dict of resident blocks), and its bounds and snapshots."""

import random

import numpy as np
import pytest

from pagevis.attach import AllBlocksCleared, BlockRemoved, BlockStored, EngineState, Fleet, StateLimits
from pagevis.attach.events import DecodedBatch


def batch(*events, ts=0.0):
    return DecodedBatch(ts, tuple(events), 0, "map")


def stored(hashes, parent=None, size=2, medium="GPU", group=None, **extra):
    tokens = [h % 1000 + i for h in hashes for i in range(size)]
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=size,
                       medium=medium, group_idx=group, **extra)


class Reference:
    """Resident blocks as {(medium, group): {hash: parent}}: what the state must agree with."""

    def __init__(self):
        self.tiers = {}

    def apply(self, event):
        if isinstance(event, AllBlocksCleared):
            self.tiers = {}
            return
        tier = self.tiers.setdefault((event.medium or "GPU", event.group_idx), {})
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for h in event.block_hashes:
                tier.setdefault(h, parent)
                parent = h
        else:
            for h in event.block_hashes:
                tier.pop(h, None)


def check_agrees(state, reference):
    snap = state.snapshot()
    cols = snap.blocks
    rows = {(snap.tiers[t].medium, snap.tiers[t].group, cols.hashes[r]): r
            for r, t in enumerate(cols.tier) if cols.resident[r]}
    expected = {(m, g, h) for (m, g), tier in reference.tiers.items() for h in tier}
    assert set(rows) == expected
    for (medium, group), tier in reference.tiers.items():
        for h, parent in tier.items():
            row = rows[(medium, group, h)]
            assert cols.parents[row] == parent
            want_parent_row = rows.get((medium, group, parent), -1) if parent != h else -1
            assert cols.parent_row[row] == want_parent_row
            assert sorted(state.children(h, medium, group)) == sorted(c for c, p in tier.items() if p == h)
        assert sorted(state.roots(medium, group)) == sorted(
            h for h, p in tier.items() if p is None or p == h or p not in tier)
    counts = {}
    for (medium, _), tier in reference.tiers.items():
        counts[medium] = counts.get(medium, 0) + len(tier)
    assert {m: n for m, n in state.resident_by_medium().items() if n} == {m: n for m, n in counts.items() if n}


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_agree_with_the_reference(seed):
    rng = random.Random(seed)
    state, reference = EngineState("e"), Reference()
    for seq in range(300):
        events = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            medium = rng.choice(["GPU", "GPU", "CPU", None])
            group = rng.choice([None, 0, 1])
            if roll < 0.55:
                n = rng.randint(1, 4)
                start = rng.randrange(60)
                parent = rng.choice([None, rng.randrange(60)])
                events.append(stored(range(start, start + n), parent, medium=medium, group=group))
            elif roll < 0.97:
                events.append(BlockRemoved(block_hashes=rng.sample(range(64), rng.randint(1, 5)), medium=medium,
                                           group_idx=group))
            else:
                events.append(AllBlocksCleared())
        for event in events:
            reference.apply(event)
        state.apply_batch(seq, batch(*events, ts=float(seq)))
        if seq % 25 == 0:
            check_agrees(state, reference)
    check_agrees(state, reference)


def test_a_block_keeps_its_tokens_parent_medium_seq_ts_and_extras():
    state = EngineState("e")
    state.apply_batch(7, batch(stored([10, 11], parent=9, size=3, lora_name="ad", session_id="s",
                                      extra_keys=[None, ["salt"]]), ts=12.5))
    info = state.block(11)
    assert (info.parent, info.token_ids, info.block_size, info.seq, info.ts) == (10, (11, 12, 13), 3, 7, 12.5)
    assert dict(info.extras) == {"lora_name": "ad", "session_id": "s", "extra_keys": ["salt"]}
    assert dict(state.block(10).extras) == {"lora_name": "ad", "session_id": "s"}
    assert state.block(11, "CPU") is None


def test_same_hash_on_two_media_and_reuse_reports():
    state = EngineState("e")
    state.apply_batch(0, batch(stored([1, 2]), stored([1], medium="CPU"), stored([1, 2])))
    assert state.resident_by_medium() == {"GPU": 2, "CPU": 1}
    assert state.counters().reused_stores == 2
    state.apply_batch(1, batch(BlockRemoved(block_hashes=[1], medium="GPU"), BlockRemoved(block_hashes=[5],
                                                                                            medium="GPU")))
    assert state.resident_by_medium() == {"GPU": 1, "CPU": 1}
    assert state.counters().unknown_removes == 1
    assert state.roots() == [2]  # its parent left the GPU: a root until it comes back
    state.apply_batch(2, batch(stored([1])))
    assert state.roots() == [1] and state.children(1) == [2]


def test_counters_history_lifetimes_and_hot_prefixes():
    state = EngineState("e", StateLimits(hot_window_s=5.0, history=4))
    state.apply_batch(0, batch(stored([1, 2, 3]), ts=100.0))
    state.apply_batch(1, batch(BlockRemoved(block_hashes=[3, 2], medium="GPU"), ts=101.0))
    state.apply_batch(2, batch(stored([2], parent=1), ts=103.0))  # back 2 s after its removal: hot
    state.apply_batch(3, batch(BlockRemoved(block_hashes=[2], medium="GPU"), ts=104.0))
    state.apply_batch(4, batch(stored([2], parent=1), ts=110.0))  # back after 6 s: not hot
    snap = state.snapshot()
    c = snap.counters
    assert (c.batches, c.last_seq, c.blocks_stored, c.blocks_removed) == (5, 4, 5, 3)
    assert dict(c.events) == {"BlockStored": 3, "BlockRemoved": 2, "AllBlocksCleared": 0}
    assert snap.history.seq.tolist() == [1, 2, 3, 4]  # the ring keeps the last 4
    assert snap.history.stored.tolist() == [0, 1, 0, 1] and snap.history.removed.tolist() == [2, 0, 1, 0]
    assert snap.history.resident.tolist() == [1, 2, 1, 2]
    assert snap.lifetimes.tolist() == [1.0, 1.0, 1.0] and snap.lifetimes_total == 3
    assert [(h.hash, h.restores, h.last_gap_s) for h in snap.hot] == [(2, 1, 2.0)]
    assert [b.hash for b in snap.recent_removed] == [3, 2, 2] and snap.recent_stored[-1].seq == 4


def test_clear_epoch_and_limits():
    state = EngineState("e", StateLimits(max_blocks=3))
    state.apply_batch(0, batch(stored([1, 2, 3, 4, 5])))
    assert state.resident_blocks == 3 and state.counters().dropped_stores == 2
    state.apply_batch(1, batch(AllBlocksCleared()))
    assert state.resident_blocks == 0 and state.counters().blocks_removed == 3
    state.apply_batch(2, batch(stored([7])))
    state.start_epoch()
    c = state.counters()
    assert (state.resident_blocks, c.epoch, c.last_seq, c.batches) == (0, 1, None, 3)


def test_snapshots_are_immutable_and_independent():
    state = EngineState("e")
    state.apply_batch(0, batch(stored([1, 2])))
    snap = state.snapshot()
    state.apply_batch(1, batch(BlockRemoved(block_hashes=[1, 2], medium="GPU"), stored([9])))
    assert snap.blocks.resident.tolist() == [True, True] and snap.blocks.hashes == (1, 2)
    for column in (snap.blocks.resident, snap.blocks.parent_row, snap.blocks.ts, snap.history.seq, snap.lifetimes):
        with pytest.raises(ValueError):
            column[0] = 0
    assert snap.blocks.token_ids(1).tolist() == [2, 3]
    with pytest.raises(Exception):
        snap.name = "x"


def test_fleet_counts_gpu_blocks_held_by_two_or_more_engines():
    fleet = Fleet()
    a, b, c = fleet.add("a"), fleet.add("b"), fleet.add("c")
    a.apply_batch(0, batch(stored([1, 2, 3]), stored([3], group=1)))
    b.apply_batch(0, batch(stored([2, 3]), stored([4], medium="CPU")))
    c.apply_batch(0, batch(stored([3, 4], medium="CPU")))
    assert fleet.shared_gpu_blocks() == 2  # 2 and 3; CPU copies do not count
    a.apply_batch(1, batch(BlockRemoved(block_hashes=[3], medium="GPU")))
    assert fleet.shared_gpu_blocks() == 2  # a still holds 3 on GPU in group 1
    a.apply_batch(2, batch(BlockRemoved(block_hashes=[3], medium="GPU", group_idx=1)))
    assert fleet.shared_gpu_blocks() == 1
    b.apply_batch(1, batch(AllBlocksCleared()))
    assert fleet.shared_gpu_blocks() == 0 and fleet.snapshot(blocks=False).shared_blocks == 0
    brute = [set(h for h in e.snapshot().blocks.hashes if h is not None) for e in (a, b)]
    assert brute == [{1, 2}, set()]


def test_token_storage_is_four_bytes_a_token():
    state = EngineState("e")
    state.apply_batch(0, batch(stored(range(100), size=16)))
    cols = state.snapshot().blocks
    assert {len(t) for t in cols.tokens} == {64}
    assert np.array_equal(cols.token_ids(5), [5 + i for i in range(16)])


def test_removal_memory_and_hot_table_are_bounded():
    state = EngineState("e", StateLimits(removed_memory=2, hot_capacity=1, hot_window_s=100.0))
    state.apply_batch(0, batch(stored([1, 2, 3])))
    state.apply_batch(1, batch(BlockRemoved(block_hashes=[1, 2, 3], medium="GPU"), ts=1.0))  # 1 forgotten
    state.apply_batch(2, batch(stored([1, 2, 3]), ts=2.0))
    assert [h.hash for h in state.snapshot().hot] == [3]  # 2 and 3 were remembered; the table holds one
    tier = state._tiers[("GPU", None)]
    assert len(tier.removed_at) <= 2

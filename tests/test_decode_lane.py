"""The decode lane (LayerTable.lane_*, batch_writes.write_many): a table's lowest empty slot known while its
sequence decodes, its writes taken out of the hole set only when someone reads `holes`. Through random mixes of
batched decode steps, prefills, evictions, forks, prefix hits and frees, every table's holes as the lane sees them
are the empty slots of its pages and the ones single appends leave, without anyone reading `holes` (which would stop
the lane); and in an engine's decode steps the lanes keep running from one step to the next."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagevis.kvcache import CacheConfig, ConfigError, KVCacheManager, make_policy
from pagevis.kvcache.sequence import LayerTable

PS, N_KV, HEAD_DIM = 4, 2, 8
CONFIG = CacheConfig(page_size=PS, max_pages=12, n_layers=2, n_heads=4, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                     policy="none", sliding_windows=(None, 7))


def _lane_holes(table: LayerTable) -> set[int]:
    """The table's empty slots as its lane has them (reading `holes` would apply and stop the lane)."""
    if table.lane_next < 0:
        return set(table.hole_set)
    assert table.lane_from <= table.lane_next <= table.lane_end
    assert set(range(table.lane_from, table.lane_end)) <= table.hole_set
    return table.hole_set - set(range(table.lane_from, table.lane_next))


def _check(cache: KVCacheManager) -> tuple:
    """The lane's invariants in every table; the tables, stores and events, read without stopping a lane."""
    layers = []
    for manager, store in zip(cache.layers, cache.stores, strict=True):
        tables = {}
        for seq_id, table in manager.tables.items():
            holes = _lane_holes(table)
            empty = {p * PS + s for p in table.pages for s in range(PS) if store.positions[p * PS + s] < 0}
            assert holes == empty, (seq_id, manager.layer)
            assert table.n_holes() == len(holes)
            if 0 <= table.lane_next < table.lane_end:
                assert table.lane_next == min(holes)
            tables[seq_id] = (list(table.pages), sorted(holes), table.resident, table.floor, table.dropped,
                              table.slid, {name: a.tobytes() for name, a in table.state.arrays.items()})
        layers.append((tables, store.k.view(np.uint32).tobytes(), store.positions.tobytes(), store.fill.tobytes(),
                       store.pages.ref_counts.tobytes(), sorted(store.pages.frame_hash.items())))
    return layers, {s: seq.newest for s, seq in cache.sequences.items()}, repr(cache.take_events())


def _policy(name: str):
    return make_policy(dataclasses.replace(CONFIG, policy=name, policy_params={}))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_lane_keeps_every_table_exact_through_random_steps(seed):
    rng = np.random.default_rng(seed)
    batched, single = (KVCacheManager(CONFIG, pool_pages=60) for _ in range(2))
    caches, live, next_id = (batched, single), [], 0
    prompts: dict[int, list[int]] = {}

    def add(parent: int | None = None) -> None:
        nonlocal next_id
        seq_id, next_id = next_id, next_id + 1
        if parent is not None:
            n = single.n_tokens(parent) - int(rng.integers(0, 3))  # (a partial page: copied, or shared)
            try:
                single.fork(parent, seq_id, n)
            except ConfigError:  # (the local layer slid past n)
                n = single.n_tokens(parent)
                single.fork(parent, seq_id, n)
            batched.fork(parent, seq_id, n)
            prompts[seq_id] = prompts[parent][:n]
        else:
            policy = str(rng.choice(["none", "none", "sinks", "h2o"]))
            prompt = list(range(30, 39)) if rng.random() < 0.6 else [int(t) for t in rng.integers(0, 50, 6)]  # (hits)
            hit = 0
            for cache in caches:
                cache.add_sequence(seq_id, _policy(policy))
                hit = cache.match_prefix(seq_id, prompt)
            rest = prompt[hit:]
            for cache in caches:
                cache.extend(seq_id, rest)
            for layer in range(CONFIG.n_layers):
                k, v = (rng.standard_normal((len(rest), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
                for cache in caches:
                    cache.append(seq_id, layer, k, v, np.arange(hit, len(prompt)))
            for cache in caches:
                cache.commit(seq_id, prompt_done=True)
            prompts[seq_id] = prompt
        live.append(seq_id)

    for _ in range(3):
        add()
    for step in range(40):
        roll = rng.random()
        if roll < 0.1 and len(live) < 6:
            add(int(rng.choice(live)))
        elif roll < 0.2 and len(live) < 6:
            add()
        elif roll < 0.28 and len(live) > 2:
            gone = live.pop(int(rng.integers(len(live))))
            for cache in caches:
                cache.free(gone)
        positions = np.array([single.n_tokens(s) for s in live], np.int64)
        for cache in caches:
            cache.step = step
            for seq_id in live:
                cache.extend(seq_id, [step])
        for layer in range(CONFIG.n_layers):
            k, v = (rng.standard_normal((len(live), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((len(live), CONFIG.n_heads, HEAD_DIM)).astype(np.float32)
            attended = step % 2 == 0 and batched.decode_many(live, layer, q, k, v, positions) is not None
            if not attended:
                batched.append_many(live, layer, k, v, positions)
            for i, seq_id in enumerate(live):
                single.append(seq_id, layer, k[i: i + 1], v[i: i + 1], positions[i: i + 1])
            if attended:  # (the statistics a batched attention feeds: test_batched_append's decode_many test)
                single.attend_many(live, layer, q, positions)
        for cache in caches:
            for seq_id in live:
                cache.commit(seq_id)
            cache.admission.free_slots(live[0])
        assert _check(batched) == _check(single), f"step {step}"
    assert any(t.lane_next >= 0 for manager in batched.layers for t in manager.tables.values())
    for manager, other in zip(batched.layers, single.layers, strict=True):  # (`holes` read: the lanes stop)
        assert {s: t.holes for s, t in manager.tables.items()} == {s: t.holes for s, t in other.tables.items()}
        assert all(t.lane_next < 0 for t in manager.tables.values())


def test_an_engines_decode_steps_keep_the_lanes_running(monkeypatch):
    """In an engine's decode steps (the scheduler's questions, commits, the batched attention) nothing reads a
    table's `holes`: a lane starts once per page a sequence fills, not at every write."""
    from pagevis.engine import Engine, SamplingConfig, SessionConfig
    from pagevis.engine.batch import BatchConfig
    from pagevis.kvcache import batch_writes, kv_cache_manager
    from pagevis.model.synthetic import SyntheticModel

    starts, start_lane, write_many = [], batch_writes._start_lane, kv_cache_manager.write_many
    writes = []
    monkeypatch.setattr(batch_writes, "_start_lane", lambda *a: starts.append(1) or start_lane(*a))
    monkeypatch.setattr(kv_cache_manager, "write_many", lambda layer, seqs, *a: writes.append(len(seqs)) or write_many(
        layer, seqs, *a))
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
    config = SessionConfig(page_size=8, max_pages=32, policy="none", max_new_tokens=33, chat=False,
                           sampling=SamplingConfig(mode="greedy"))
    engine = Engine(model, config, BatchConfig(max_seqs=4))
    for i in range(4):
        engine.submit(list(b"Pages let sequences share a pool.")[: 20 + i])
    while not engine.done:
        engine.step()
    assert sum(writes) >= 4 * 30 * 2
    # one a page and layer (the write that finds it full: the next page's lane runs on) and the first: not one a write
    assert len(starts) <= sum(writes) // 8 + 4 * 2, (len(starts), sum(writes))

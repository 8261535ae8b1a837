"""Compression beyond a fixed budget against brute-force references written here: threshold eviction (DMS-style,
the cache's size floats), value merging (CaM-style: an evicted value folded into its most similar survivor)
and periodic compression (compress_every, kvpress's DecodingPress). Each reference recomputes from the
attention the cache returned and the K/V written, by position, sharing no code with the policies."""

from collections import deque

import numpy as np
import pytest

from engine_reference import weight_positions

from pagevis.kvcache import CacheConfig, ConfigError, KVCacheManager

N_KV, N_HEADS, D = 2, 4, 8


def make_cache(policy, max_pages, **params):
    return KVCacheManager.single(CacheConfig(page_size=4, max_pages=max_pages, n_layers=1, n_heads=N_HEADS,
                                             n_kv_heads=N_KV, head_dim=D, policy=policy, policy_params=params))


class Stream:
    """Random K/V written one token at a time, one query attending after each; what the cache returned."""

    def __init__(self, cache, seed):
        self.cache, self.rng = cache, np.random.default_rng(seed)
        self.k, self.v = {}, {}

    def write(self, p):
        k = self.rng.standard_normal((1, N_KV, D)).astype(np.float32)
        v = self.rng.standard_normal((1, N_KV, D)).astype(np.float32)
        self.k[p], self.v[p] = k[0].astype(np.float64), v[0].astype(np.float64)
        self.cache.append(0, 0, k, v, np.array([p]))
        events = [e for e in self.cache.take_events() if e.kind == "evict"]
        return events

    def attend(self, p):
        """{position: head-mean attention of this query}."""
        q = self.rng.standard_normal((1, N_HEADS, D)).astype(np.float32) * 2
        result = self.cache.attend(0, 0, q, np.array([p]))
        positions = weight_positions(self.cache, 0, result)
        weights = result.weights[0].mean(axis=0)
        return {int(pos): float(w) for pos, w in zip(positions, weights, strict=True) if pos >= 0}


def test_threshold_evicts_exactly_the_tokens_below_it_and_the_size_floats():
    window, pct = 4, 60
    cache = make_cache("threshold", max_pages=40, window=window, threshold_pct=pct)  # a ceiling never reached
    stream = Stream(cache, seed=0)
    resident, rows, sizes = [], deque(maxlen=window), []
    for p in range(120):
        expected = set()
        if rows:
            protected = set(sorted(resident)[-window:])
            for pos in resident:
                score = sum(row.get(pos, 0.0) for row in rows) / len(rows)
                if pos not in protected and score < pct / 100 / len(resident):
                    expected.add(pos)
        evicted = {e.position for e in stream.write(p)}
        assert evicted == expected, p
        resident = [pos for pos in resident if pos not in evicted] + [p]
        assert cache.resident_positions(0, 0).tolist() == resident
        rows.append(stream.attend(p))
        sizes.append(len(resident))
    assert max(sizes) < 160 and len(set(sizes[40:])) > 3  # under the ceiling, and not one fixed size
    assert 5 < sizes[-1] < 40  # it evicted, by the threshold alone


def test_threshold_keeps_the_capacity_as_a_ceiling():
    cache = make_cache("threshold", max_pages=4, window=4, threshold_pct=0)  # 0: nothing is below it
    stream = Stream(cache, seed=1)
    for p in range(40):
        stream.write(p)
        stream.attend(p)
        assert cache.resident(0, 0) == min(p + 1, 16)


def test_merging_folds_each_victim_into_its_most_similar_survivor():
    recent = 3
    cache = make_cache("merge", max_pages=3, recent=recent)
    stream = Stream(cache, seed=2)
    v, acc, merges = {}, {}, 0
    for p in range(70):
        events = stream.write(p)
        for event in events:
            e = event.position
            survivors = sorted(pos for pos in v if pos != e)
            older = [pos for pos in survivors + [e] if pos not in sorted(v)[-recent:]]
            lowest = min(acc[pos] for pos in older)
            assert e == min(pos for pos in older if acc[pos] == lowest)  # H2O's victim, ties to the oldest

            def unit(x):
                return x / np.linalg.norm(x, axis=-1, keepdims=True)
            similarity = {s: float(np.sum(unit(stream.k[s]) * unit(stream.k[e]))) for s in survivors}
            target = max(survivors, key=lambda s: (similarity[s], -s))
            assert event.detail == target
            mass = acc[target] + acc[e]
            v[target] = (acc[target] * v[target] + acc[e] * v[e]) / mass
            acc[target] = mass
            del v[e], acc[e]
            merges += 1
        v[p], acc[p] = stream.v[p], 0.0
        for pos, weight in stream.attend(p).items():
            acc[pos] += weight
        store = cache.stores[0]
        for flat in np.flatnonzero(store.positions >= 0):
            page, slot = divmod(int(flat), 4)
            np.testing.assert_allclose(store.v[:, page, slot], v[int(store.positions[flat])], rtol=0, atol=1e-5)
    assert merges == 70 - 12


@pytest.mark.parametrize("every", [1, 5, 11])
def test_periodic_compression_evicts_in_bursts_down_to_capacity_minus_n(every):
    cache = make_cache("sinks", max_pages=6, n_sink=2, compress_every=every)
    stream = Stream(cache, seed=3)
    resident, bursts = [], []
    for p in range(90):
        if len(resident) == 24:  # full: the n oldest non-sink tokens go at once
            resident = resident[:2] + resident[2 + every:]
        evicted = stream.write(p)
        if evicted:
            bursts.append(len(evicted))
        resident.append(p)
        assert cache.resident_positions(0, 0).tolist() == resident
        stream.attend(p)
    assert set(bursts) == {every}


def test_periodic_compression_with_a_scoring_policy_stays_within_its_budget():
    cache = make_cache("h2o", max_pages=6, recent=4, compress_every=8)
    stream = Stream(cache, seed=4)
    bursts = []
    for p in range(80):
        evicted = stream.write(p)
        stream.attend(p)
        if evicted:
            bursts.append(len(evicted))
        assert cache.resident(0, 0) <= 24
    assert bursts and set(bursts) == {8}


@pytest.mark.parametrize("change,field", [({"dtype": "int8"}, "policy"), ({"policy_params": {"compress_every": 24}},
                                                                           "merge.compress_every")])
def test_bad_compression_settings_are_refused(change, field):
    with pytest.raises(ConfigError) as error:
        CacheConfig(**{**dict(page_size=4, max_pages=6, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=D,
                              policy="merge"), **change})
    assert error.value.field == field


def test_the_page_grid_draws_each_merge_from_the_evicted_cell_to_its_survivor(qtbot, tmp_path):
    pytest.importorskip("pytestqt")
    from gui_helpers import SYNTH, make_window, step

    from pagevis.engine import SessionConfig

    config = SessionConfig(page_size=4, max_pages=4, policy="merge", policy_params={"recent": 4},
                           max_new_tokens=40, chat=False)
    window = make_window(qtbot, tmp_path, spec=SYNTH, prompt="merging values", config=config)
    step(qtbot, window, 6)  # the prompt (14 byte tokens) fills the 16 slots; then one merge per step
    record, grid = window.timeline.records[-1], window.page_grid
    merges = [e for e in record.events if e.kind == "evict" and e.layer == window.controls.layer.value()]
    assert len(merges) == 1 and merges[0].detail >= 0
    xs, ys = grid.merges.getData()
    target = np.argwhere(record.slot_maps[window.controls.layer.value()] == merges[0].detail)[0]
    assert xs.tolist() == [merges[0].slot + 0.5, target[1] + 0.5]
    assert ys.tolist() == [merges[0].page + 0.5, target[0] + 0.5]
    assert f"into position {merges[0].detail}" in grid.cell_info(merges[0].page, merges[0].slot)


@pytest.mark.parametrize("policy,params", [("threshold", {"window": 4, "threshold_pct": 60}), ("merge", {}),
                                           ("sinks", {"rerotate": 1}), ("h2o", {"compress_every": 4})])
def test_a_fork_takes_no_more_pages_than_pages_needed_says(policy, params):
    """Pruning, merging into and re-rotating survivors copy the shared pages they change: the scheduler's
    bound (pages_needed, checked before a step) must cover those copies."""
    config = CacheConfig(page_size=4, max_pages=6, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=D,
                         policy=policy, policy_params=params)
    cache = KVCacheManager(config, pool_pages=40)
    cache.add_sequence(0)
    stream = Stream(cache, seed=5)
    for p in range(22):
        cache.extend(0, [p])
        stream.write(p)
        stream.attend(p)
    cache.fork(0, 1)
    copies = 0
    for p in range(22, 60):
        need = cache.admission.pages_needed(1, 1)[0]
        cache.extend(1, [p])
        k = stream.rng.standard_normal((1, N_KV, D)).astype(np.float32)
        cache.append(1, 0, k, k, np.array([p]))
        taken = [e for e in cache.take_events() if e.kind in ("allocate", "copy_on_write")]
        copies += sum(e.kind == "copy_on_write" for e in taken)
        assert len(taken) <= need, p
        cache.attend(1, 0, stream.rng.standard_normal((1, N_HEADS, D)).astype(np.float32), np.array([p]))
    assert copies > 0

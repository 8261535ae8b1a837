"""The cache's snapshot of one sequence (KVCacheManager.snapshot, kvcache/snapshot.py): what a step record is made
of, checked against the cache's own per-position answers, and the per-layer facts views read from the record."""

import numpy as np
import pytest

from pagevis.engine import DecodeSession, SamplingConfig, SessionConfig
from pagevis.kvcache.policies.pyramidkv import PyramidKV
from pagevis.model.synthetic import SyntheticModel

MODEL = SyntheticModel(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, seed=3, sliding_window=10, global_every=3)


def decoded(**settings):
    base = dict(page_size=4, max_pages=8, policy="h2o", max_new_tokens=30, chat=False,
                sampling=SamplingConfig(mode="greedy"))
    session = DecodeSession(MODEL, "a snapshot is the cache's to give", SessionConfig(**{**base, **settings}))
    for _ in session.run():
        pass
    return session


def test_the_slot_maps_hold_what_the_cache_holds_and_scores_only_where_it_does():
    session = decoded()
    snap = session.cache.snapshot(session.seq_id, session.cache_config.max_pages)
    for layer in range(MODEL.config.n_layers):
        held = snap.slot_maps[layer]
        resident = np.sort(session.cache.resident_positions(session.seq_id, layer))
        assert np.array_equal(np.sort(held[held >= 0]), resident)
        assert np.isnan(snap.scores[layer][held < 0]).all() and not snap.protected[layer][held < 0].any()
    assert snap.labels == ("local W=10", "local W=10", "global") and snap.full_precision is None
    assert snap.block_frames is None  # no disk tier, no page selection
    last = session.records[-1]
    assert np.array_equal(last.slot_maps, snap.slot_maps) and np.array_equal(last.scores, snap.scores, equal_nan=True)


def test_the_record_gives_each_layers_capacity_as_its_policy_does():
    session = decoded(policy="pyramidkv", policy_params={"window": 2}, max_pages=8)
    reference = PyramidKV(window=2)
    reference.bind(session.cache_config.capacity, 4)
    reference.bind_layers(MODEL.config.n_layers)
    expected = [reference.layer_capacity(layer) for layer in range(MODEL.config.n_layers)]
    assert len(set(expected)) > 1, "pyramidkv gives layers different budgets"
    for record in session.records:
        assert record.capacities.dtype == np.int32 and record.capacities.tolist() == expected


@pytest.mark.parametrize("settings", [dict(disk_pages=16, max_pages=4, policy="h2o"),
                                      dict(dtype="int4", policy="h2o", sliding=None)])
def test_tiers_and_quantized_storage_come_from_the_snapshot(settings):
    if settings.pop("sliding", 1) is None:  # int4 is refused beside sliding windows: a model without them
        session = DecodeSession(SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3),
                                "quantized pages", SessionConfig(page_size=4, max_pages=8, max_new_tokens=30,
                                                                 chat=False, **settings))
        for _ in session.run():
            pass
    else:
        session = decoded(**settings)
    snap = session.cache.snapshot(session.seq_id, session.cache_config.max_pages)
    record = session.records[-1]
    if session.cache_config.tiered:
        assert record.tiers is not None and tuple(record.tiers.block_frames) == snap.block_frames
        assert any(-1 in frames for frames in snap.block_frames), "some page is on disk only"
    else:
        assert snap.full_precision is not None and snap.full_precision.any()
        assert np.array_equal(record.full_precision, snap.full_precision)


def test_the_frames_a_pool_view_reads_are_read_only():
    session = decoded()
    frames = session.cache.frames(0)
    with pytest.raises(ValueError):
        frames.positions[0] = 7
    assert frames.page_size == 4 and not frames.tiered


def test_a_session_builds_its_cache_config_once_and_one_policy_per_sequence(monkeypatch):
    from pagevis.engine import engine, session as session_module
    from pagevis.kvcache import CacheConfig, kv_cache_manager

    built = {"config": 0, "session": 0, "elsewhere": 0}
    for_model = CacheConfig.for_model.__func__

    def counted_config(cls, *args, **kwargs):
        built["config"] += 1
        return for_model(cls, *args, **kwargs)

    def counted(key, make):
        def wrapper(*args, **kwargs):
            built[key] += 1
            return make(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(CacheConfig, "for_model", classmethod(counted_config))
    monkeypatch.setattr(session_module, "make_policy", counted("session", session_module.make_policy))
    for module in (engine, kv_cache_manager):  # the fallbacks that build one when none is given
        monkeypatch.setattr(module, "make_policy", counted("elsewhere", module.make_policy))
    session = decoded(max_new_tokens=6)
    assert built == {"config": 1, "session": 1, "elsewhere": 0}
    assert session.policy is session.cache.sequences[session.seq_id].policy
    session.restart()  # a new sequence: its own policy, which the step that admits it evicts by
    session.step()
    assert built["session"] == 2 and session.policy is session.cache.sequences[session.seq_id].policy

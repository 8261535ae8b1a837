"""The bounded timeline (Qt-free): records spilled to disk come back equal, the heatmap window equals one
built from whole records, and memory per step stays small."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
from pagevis.viewmodel import timeline as timeline_module
from pagevis.viewmodel.timeline import SessionInfo, Timeline

SPEC = ModelSpec(kind="synthetic", n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, seed=2)


def decoded(steps: int, config: SessionConfig, record_layers=None):
    model = SPEC.load()
    config = dataclasses.replace(config, record_layers=record_layers)
    session = DecodeSession(model, "a timeline on disk", config)
    for _ in range(steps):
        session.step()
    info = SessionInfo(SPEC.label, session.prompt, session.prompt_ids, config, 3, 4, 0, 2)
    timeline = Timeline(info, session.token_text)
    timeline.extend(session.records)
    return session, timeline


def assert_same_record(a, b) -> None:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=field.name)
            assert x.dtype == y.dtype, field.name
        elif field.name == "attention":
            assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))
        elif field.name == "events":
            assert len(x) == len(y)
            for e, f in zip(x, y):
                assert e._replace(score=0) == f._replace(score=0)
                assert e.score == f.score or (np.isnan(e.score) and np.isnan(f.score))
        elif field.name == "timings":
            assert x == pytest.approx(y)
        else:
            assert x == y, field.name


@pytest.mark.parametrize("policy,oracle,layers", [("sinks", False, None), ("h2o", True, (0, 2))])
def test_records_rebuilt_from_the_spill_file_equal_the_originals(policy, oracle, layers):
    config = SessionConfig(page_size=4, max_pages=3, policy=policy, max_new_tokens=80, oracle=oracle)
    session, timeline = decoded(40, config, layers)
    assert len(timeline) == 40
    for index in (0, 1, 17, 31, 39):  # 39 is kept whole; the others are rebuilt
        assert_same_record(timeline.records[index], session.records[index])
    assert [e.position for e in timeline.evictions] == [
        e.position for r in session.records for e in r.events if e.kind.value == "evict"]


def test_the_heatmap_window_equals_one_built_from_whole_records(monkeypatch):
    monkeypatch.setattr(timeline_module, "HEATMAP_ROWS", 16)
    monkeypatch.setattr(timeline_module, "HEATMAP_COLUMNS", 24)
    config = SessionConfig(page_size=4, max_pages=3, policy="sinks", max_new_tokens=80)
    session, timeline = decoded(50, config)
    # following the newest step (the kept window grows, then slides), scrubbing back, another head and layer
    following = [(0, None, index) for index in range(3, 50)]
    for layer, head, index in (*following, (0, None, 12), (0, 2, 12), (0, 2, 13), (2, 3, 30), (1, 0, 5), (1, 0, 49)):
        weights, evicted, first, low = timeline.attention(layer, head, index)
        n = timeline.n_positions(index)
        assert first == max(0, index + 1 - 16) and low == max(0, n - 24)
        for row, step in enumerate(range(first, index + 1)):
            record = session.records[step]
            by_position = record.attention_over_positions(layer, n)
            expected = by_position.mean(axis=0) if head is None else by_position[head]
            np.testing.assert_allclose(weights[row], expected[low:], rtol=1e-6, atol=1e-7)
            written = timeline.n_positions(step)
            gone = ~record.resident_mask(layer, n) & (np.arange(n) < written)
            np.testing.assert_array_equal(evicted[row], gone[low:])


def test_memory_per_step_is_bounded_by_what_every_step_needs():
    config = SessionConfig(page_size=8, max_pages=12, policy="sinks", max_new_tokens=400)
    _, short = decoded(100, config)
    _, long = decoded(400, config)
    per_step = (long.memory_bytes() - short.memory_bytes()) / 300
    assert per_step < 600  # 3 layers: series, offsets, a few evictions; the arrays live in the spill file
    assert long.spill.disk_bytes > 300 * 3 * 96 * 4  # the slot maps alone

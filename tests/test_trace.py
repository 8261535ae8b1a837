"""Trace files: a run round-trips exactly, and bad files are refused with a clear TraceError."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pagevis.engine import DecodeSession, ModelSpec, SamplingConfig, SessionConfig
from pagevis.trace import Trace, TraceError, VERSION, read_trace, record_differences, write_trace

SPEC = ModelSpec(kind="synthetic", n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)


def run_session(**overrides):
    config = dict(page_size=4, max_pages=5, policy="h2o", max_new_tokens=24, oracle=True,
                  sampling=SamplingConfig(mode="sample", temperature=1.0, seed=3), record_layers=(0, 2))
    config.update(overrides)
    session = DecodeSession(SPEC.load(), "pages of keys and values, evicted", SessionConfig(**config))
    for _ in session.run():
        pass
    return session


@pytest.fixture(scope="module")
def session():
    return run_session()


@pytest.fixture(scope="module")
def trace_file(session, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "run.pvtrace"
    write_trace(path, session, model_spec=SPEC)
    return path


def test_records_round_trip_exactly(session, trace_file):
    trace = read_trace(trace_file)
    assert len(trace.records) == len(session.records) > 10
    assert sum(len(r.evictions) for r in session.records) > 0, "the run should evict"
    for live, loaded in zip(session.records, trace.records):
        assert record_differences(live, loaded) == [], f"step {live.step}"
        # spot-check that the comparison itself looks at the arrays
        assert np.array_equal(live.slot_maps, loaded.slot_maps) and loaded.slot_maps.dtype == np.int32
        assert [e[:8] for e in live.events] == [e[:8] for e in loaded.events]


def test_header_fields_round_trip(session, trace_file):
    trace = read_trace(trace_file)
    assert trace.model_label == SPEC.label and trace.model_spec == SPEC
    assert trace.prompt == session.prompt and trace.prompt_ids == session.prompt_ids
    assert trace.config == session.config
    assert trace.stop_reason == session.stop_reason and trace.text == session.text()
    used = set(session.prompt_ids) | {r.next_token for r in session.records if r.next_token >= 0}
    assert {t: session.token_text(t) for t in used}.items() <= trace.token_texts.items()


def test_every_policy_and_no_attention_round_trip(tmp_path):
    for policy in ("sinks", "oldest-page", "tova", "random"):
        session = run_session(policy=policy, oracle=False, record_layers=(), dtype="float16", max_new_tokens=12)
        write_trace(tmp_path / "t", session)
        loaded = read_trace(tmp_path / "t")
        assert [record_differences(a, b) for a, b in zip(session.records, loaded.records)] == [[]] * len(session.records)


def test_record_differences_sees_a_change(session):
    record = session.records[-1]
    import dataclasses
    changed = dataclasses.replace(record, slot_maps=record.slot_maps + 1)
    assert record_differences(record, changed) == ["slot_maps"]


def test_truncated_trace_is_refused(trace_file, tmp_path):
    data = trace_file.read_bytes()
    cut = tmp_path / "cut.pvtrace"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        read_trace(cut)


def test_corrupt_trace_is_refused(trace_file, tmp_path):
    data = bytearray(trace_file.read_bytes())
    with zipfile.ZipFile(trace_file) as archive:
        info = archive.getinfo("slot_maps.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start, start + info.compress_size // 2):
        data[i] ^= 0x5A
    bad = tmp_path / "bad.pvtrace"
    bad.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="corrupt"):
        read_trace(bad)


def test_not_a_trace_and_missing_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(TraceError, match="not a pagevis trace"):
        read_trace(text)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.pvtrace")


def rewrite_header(source, target, change):
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename == "header.json":
                header = json.loads(data)
                change(header)
                data = json.dumps(header).encode()
            new.writestr(info.filename, data)


def test_future_version_says_so(trace_file, tmp_path):
    future = tmp_path / "future.pvtrace"
    rewrite_header(trace_file, future, lambda h: h.update(version=VERSION + 1))
    with pytest.raises(TraceError, match=f"newer pagevis.*version {VERSION + 1}.*up to {VERSION}"):
        read_trace(future)


def test_inconsistent_header_is_refused(trace_file, tmp_path):
    wrong = tmp_path / "wrong.pvtrace"
    rewrite_header(trace_file, wrong, lambda h: h.update(n_steps=h["n_steps"] + 1))
    with pytest.raises(TraceError):
        read_trace(wrong)


def test_trace_holds_no_pickle(trace_file):
    with zipfile.ZipFile(trace_file) as archive:
        names = archive.namelist()
        assert names[0] == "header.json" and all(n.endswith(".npy") for n in names[1:])
        for name in names[1:]:
            dtype = np.lib.format.read_array(archive.open(name), allow_pickle=False).dtype
            assert dtype.kind != "O"


def test_trace_object_writes_too(session, tmp_path):
    trace = Trace.from_session(session, model_spec=SPEC)
    write_trace(tmp_path / "a", trace)
    assert len(read_trace(tmp_path / "a").records) == len(session.records)


@pytest.mark.parametrize("tier", [{"max_pages": 3, "disk_pages": 12},
                                  {"max_pages": 3, "disk_pages": 12, "select": "quest"},
                                  {"max_pages": 5, "select": "quest", "select_pages": 2}])
def test_disk_tier_and_page_selection_round_trip(tmp_path, tier):
    session = run_session(**tier)
    assert all(r.tiers is not None for r in session.records)
    assert any(e.kind.value in ("swap_out", "fault_in") for r in session.records for e in r.events) or "disk_pages" not in tier
    write_trace(tmp_path / "t", session)
    loaded = read_trace(tmp_path / "t")
    assert loaded.config == session.config
    assert [record_differences(a, b) for a, b in zip(session.records, loaded.records)] == [[]] * len(session.records)
    assert [e.frame for r in loaded.records for e in r.events] == [e.frame for r in session.records for e in r.events]


def test_a_version_1_trace_still_opens():
    trace = read_trace(Path(__file__).parent / "data" / "hostile" / "valid.pvtrace")  # written before the disk tier
    assert trace.records and all(r.tiers is None for r in trace.records)
    assert trace.config.disk_pages == 0 and trace.config.select == "all"
    assert all(e.frame == -1 for r in trace.records for e in r.events)


def test_per_head_policies_and_the_oracle_per_head_round_trip(tmp_path):
    """Version 4: mask events (a per-head policy's drops) and the oracle's lost attention per recorded layer
    and query head come back exactly; the per-head shares average to the step's lost attention where all
    layers are recorded."""
    for policy, params in (("adakv", {"budget": 8}), ("keydiff", {}), ("expected-attention", {})):
        session = run_session(policy=policy, policy_params=params, record_layers=(0, 1, 2), max_new_tokens=16)
        write_trace(tmp_path / "t", session)
        loaded = read_trace(tmp_path / "t")
        assert [record_differences(a, b) for a, b in zip(session.records, loaded.records)] == [[]] * len(session.records)
        last = loaded.records[-1]
        assert np.shape(last.oracle.lost_by_head) == (3, 4)
        assert np.isclose(np.mean(last.oracle.lost_by_head), last.oracle.lost_attention, atol=1e-6)
        masks = [e for r in loaded.records for e in r.events if e.kind.value == "mask"]
        assert bool(masks) == (policy == "adakv")

"""The step record's field table (engine/step_record.py FIELDS): one row is all a new field needs for the record
to round-trip through the timeline's spill and a trace file, and traces written before it still read."""

import dataclasses

import numpy as np
import pytest

from pagevis.engine import DecodeSession, ModelSpec, SessionConfig, StepRecord, step_record
from pagevis.engine.record_fields import RecordField
from pagevis.trace import Trace, TraceError, VERSION, read_trace, record_differences, write_trace
from pagevis.trace import file as trace_file
from pagevis.trace.schema import arrays, format_version
from pagevis.viewmodel import spill

SPEC = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=2)
# Two new fields: a float grid (optional, delta-encoded: the hardest path) and a scalar with a range.
HEAT = RecordField("heat", "np.ndarray | None", "(n_layers, max_pages, page_size) float32, a test's grid",
                   "grid", "<f4", default=None, optional=True, delta=True, since=VERSION + 1)
NEWEST = RecordField("newest", "int", "a test's scalar: the newest position", "scalar", "<i4", default=-1,
                     since=VERSION + 1, bounds=(-1, "N-1"))


@pytest.fixture(scope="module")
def session():
    config = SessionConfig(page_size=4, max_pages=4, policy="h2o", max_new_tokens=16, oracle=True, dtype="int4",
                           record_layers=(1,))
    session = DecodeSession(SPEC.load(), "a record declared once", config)
    for _ in session.run():
        pass
    return session


@pytest.fixture
def wider(monkeypatch):
    """The table with HEAT and NEWEST: as if both rows had been added to FIELDS."""
    table = step_record.TABLE.with_field(HEAT).with_field(NEWEST)
    monkeypatch.setattr(step_record, "TABLE", table)
    return table


def widened(table, records):
    """The session's records as records of the wider table: heat on every other step, newest its last position."""
    out = []
    for r in records:
        fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(StepRecord)}
        heat = r.scores * 2 if r.step % 2 else None
        out.append(table.record(**fields, heat=heat, newest=max(r.positions)))
    return out


def test_a_new_field_round_trips_through_the_spill(session, wider):
    records = widened(wider, session.records)
    store = spill.RecordSpill()
    try:
        for record in records:
            store.append(record)
        assert "heat" in store.parts
        for index, record in enumerate(records):
            back = store.record(index, session.token_text)
            assert type(back) is wider.record and record_differences(record, back) == []
        assert records[1].heat is not None and records[0].heat is None
    finally:
        store.close()


def test_a_new_field_round_trips_through_a_trace(session, wider, tmp_path):
    records = widened(wider, session.records)
    trace = Trace.from_session(session, model_spec=SPEC)
    trace.records = records
    write_trace(tmp_path / "wide.pvtrace", trace)
    loaded = read_trace(tmp_path / "wide.pvtrace")
    assert format_version() == VERSION + 1 and {"heat", "has_heat", "newest"} <= set(arrays())
    for record, back in zip(records, loaded.records, strict=True):
        assert record_differences(record, back) == [], f"step {record.step}"
    assert np.array_equal(loaded.records[1].heat, records[1].heat) and loaded.records[2].newest > 0


def test_a_trace_written_before_the_field_still_reads(session, tmp_path, monkeypatch):
    write_trace(tmp_path / "old.pvtrace", session, model_spec=SPEC)  # the table as it is
    table = step_record.TABLE.with_field(HEAT).with_field(NEWEST)
    monkeypatch.setattr(step_record, "TABLE", table)
    loaded = read_trace(tmp_path / "old.pvtrace")
    assert all(r.heat is None and r.newest == -1 for r in loaded.records)
    for live, back in zip(session.records, loaded.records, strict=True):
        assert record_differences(live, back) == []  # every field the session knows


def test_a_fields_bounds_are_checked_when_a_trace_is_read(session, wider, tmp_path):
    records = widened(wider, session.records)
    records[3] = dataclasses.replace(records[3], newest=10_000)  # past the trace's last position
    trace = Trace.from_session(session, model_spec=SPEC)
    trace.records = records
    write_trace(tmp_path / "bad.pvtrace", trace)
    with pytest.raises(TraceError, match="array 'newest' holds 10000, outside -1..") as error:
        read_trace(tmp_path / "bad.pvtrace")
    assert "bad.pvtrace" in str(error.value)


def test_a_newer_trace_is_refused_by_the_table_without_the_field(session, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        table = step_record.TABLE.with_field(HEAT)
        patch.setattr(step_record, "TABLE", table)
        trace = Trace.from_session(session, model_spec=SPEC)
        trace.records = [table.record(**{f.name: getattr(r, f.name) for f in dataclasses.fields(StepRecord)})
                         for r in session.records]
        write_trace(tmp_path / "new.pvtrace", trace)
    with pytest.raises(TraceError, match=f"newer pagevis.*version {VERSION + 1}"):
        read_trace(tmp_path / "new.pvtrace")


def test_every_custom_field_has_its_codec_in_the_spill_and_the_trace():
    custom = {f.name for f in step_record.FIELDS if f.stored == "custom"}
    assert custom == set(spill.CUSTOM_FIELDS) == set(trace_file.CUSTOM_FIELDS)


def test_the_table_refuses_what_it_could_not_store():
    with pytest.raises(ValueError, match="needs a default"):
        RecordField("late", "int", "", "scalar", "<i8", since=VERSION + 1)
    with pytest.raises(ValueError, match="only a grid or layers field may be optional"):
        RecordField("maybe", "int", "", "scalar", "<i8", default=None, optional=True)
    with pytest.raises(ValueError, match="named twice"):
        step_record.TABLE.with_field(RecordField("step", "int", "", "scalar", "<i8", default=0))


def test_the_record_is_a_class_declared_in_source_with_every_annotation_resolved():
    """A type checker and an editor see StepRecord's fields: its declaration is source text (a class made at run
    time has none), and every annotation names a type the module has."""
    import inspect
    import typing

    lines, _ = inspect.getsourcelines(StepRecord)
    declared = [line.split(":")[0].strip() for line in lines if line.startswith("    ") and ": " in line
                and "= field(" in line]
    assert declared == [f.name for f in step_record.FIELDS]
    hints = typing.get_type_hints(StepRecord)
    assert [hints[f.name] for f in step_record.FIELDS][:2] == [int, str]

"""The attention-weight histogram: what it computes from a record (against a direct count), and the window's
Weights view showing the selected step, layer and head, with the oracle's evicted share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from pagevis.engine import DecodeSession  # noqa: E402
from pagevis.viewmodel.histogram import BINS_PER_DECADE, EDGES, weight_histogram  # noqa: E402

from gui_helpers import CONFIG, PROMPT, SYNTH, make_window, step  # noqa: E402

ORACLE = dataclasses.replace(CONFIG, oracle=True, max_pages=3)


def direct(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and attention per bin, counted one weight at a time."""
    counts, mass = np.zeros(len(EDGES) - 1, int), np.zeros(len(EDGES) - 1)
    for w in weights:
        if w <= 0:
            continue
        b = min(max(int(np.floor((np.log10(w) - EDGES[0]) * BINS_PER_DECADE)), 0), len(EDGES) - 2)
        counts[b] += 1
        mass[b] += w
    return counts, mass


@pytest.fixture(scope="module")
def records():
    session = DecodeSession(SYNTH.load(), PROMPT, dataclasses.replace(ORACLE, max_new_tokens=6))
    return [session.step() for _ in range(4)]


@pytest.mark.parametrize("head", [None, 0, 3])
def test_histogram_counts_the_records_weights(records, head):
    record = records[-1]
    data = weight_histogram(record, 1, head)
    resident = record.page_map(1).ravel() >= 0
    weights = record.attention[1][:, resident].astype(np.float64)
    weights = weights.mean(axis=0) if head is None else weights[head]
    counts, mass = direct(weights)
    assert data.counts.tolist() == counts.tolist() and np.allclose(data.mass, mass)
    assert data.tokens == counts.sum() == 12 and data.mass.sum() == pytest.approx(1, abs=2e-3)
    p = weights[weights > 0] / weights.sum()
    assert data.entropy == pytest.approx(-(p * np.log(p)).sum()) and data.max_weight == weights.max()
    by_head = np.array(record.oracle.lost_by_head[1])
    assert data.lost == pytest.approx(by_head.mean() if head is None else by_head[head])
    assert 0 < data.lost < 1  # the cache has evicted tokens the full cache still attends to


def test_histogram_needs_the_layers_attention(records):
    unrecorded = dataclasses.replace(records[-1], attention_layers=(0,), attention=records[-1].attention[:1])
    assert weight_histogram(unrecorded, 1, None) is None
    no_oracle = dataclasses.replace(records[-1], oracle=None)
    assert weight_histogram(no_oracle, 0, None).lost is None


def test_weights_view_shows_the_selected_step(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path, SYNTH, PROMPT, ORACLE)
    window.docks["Weights"].raise_()
    step(qtbot, window, 3)
    view = window.histogram
    record = window.timeline.record(window.index)
    expected = weight_histogram(record, 0, None)
    assert view.data.counts.tolist() == expected.counts.tolist() and view.data.lost == expected.lost
    assert view.count_bars.opts["height"].tolist() == expected.counts.tolist()
    assert view.evicted_bar.opts["height"] == [expected.lost]
    window.controls.layer.setValue(1)
    window.controls.head.setCurrentIndex(2)  # query head 1
    window.redraw()
    assert view.data.counts.tolist() == weight_histogram(record, 1, 1).counts.tolist()
    window.scrub(0)
    window.redraw()
    assert view.data.tokens == weight_histogram(window.timeline.record(0), 1, 1).tokens


@pytest.mark.parametrize("tier", [{}, {"max_pages": 2, "disk_pages": 4}])
def test_the_spill_file_keeps_the_per_head_lost_attention(tier):
    """The timeline's spill file gives back the oracle's per-head shares (after the tier recall, with a disk
    tier) exactly."""
    from pagevis.viewmodel.spill import RecordSpill

    session = DecodeSession(SYNTH.load(), PROMPT, dataclasses.replace(ORACLE, max_new_tokens=4, **tier))
    spill = RecordSpill()
    for _ in range(3):
        spill.append(session.step())
    for index, record in enumerate(session.records):
        again = spill.record(index, session.token_text)
        assert again.oracle == record.oracle and again.oracle.lost_by_head is not None
        assert (again.tiers is None) == (not tier)
        if tier:
            assert np.array_equal(again.tiers.recall, record.tiers.recall)
    spill.close()

"""The attach window (pytest-qt, offscreen): fed the recordings made from vLLM's and SGLang's own publisher code, its
forest and per-medium counts equal an independent playback's snapshot at several scrub positions; hover text;
a removed block marked, then gone; decode errors shown; live over real ZMQ sockets (counts follow, overlap between
two engines, --record, --metrics); closing stops every thread. The forest layout against a brute-force reference.
Every wait is bounded."""

import json
import pathlib
import time

import numpy as np
import pytest
from PySide6.QtCore import Qt

from metrics_endpoint import metrics_endpoint

from pagevis.attach import BlockRemoved, BlockStored, encode_batch
from pagevis.attach.playback import Playback
from pagevis.attach.recording import LIVE, Recorder, read_recording
from pagevis.viewmodel.forest_layout import layout_forest, subtree
from pagevis.viewmodel.forest_rows import REMOVED, SHARED, ColourClass, ForestRow, ForestRows

DATA = pathlib.Path(__file__).parent / "data" / "kv_events"
TOPIC = "kv-events"
WAIT_MS = 20_000


# --- the layout, against a brute-force reference ----------------------------------------------------------------
def brute_layout(parent, tokens, order):
    """Recursive icicle: x = tokens of the ancestors, y = leaves before, height = leaves below."""
    n = len(parent)
    kids = {i: [] for i in range(-1, n)}
    for row, p in enumerate(parent):
        kids[p].append(row)
    for children in kids.values():
        children.sort(key=lambda r: (order[r], r))
    leaves, x, y = {}, {}, {}

    def count(row):
        leaves[row] = sum(count(c) for c in kids[row]) or 1
        return leaves[row]

    def place(row, x0, y0):
        x[row], y[row] = x0, y0
        for child in kids[row]:
            place(child, x0 + tokens[row], y0)
            y0 += leaves[child]

    at = 0
    for root in kids[-1]:
        count(root)
        place(root, 0, at)
        at += leaves[root]
    return x, y, leaves


def random_forest(rng, n, chains=0.0):
    """A random forest, parents shuffled among the rows; `chains`: how often a node continues the previous one
    (long unary paths, as prompts make)."""
    parent = np.array([(i - 1 if rng.random() < chains else rng.integers(-1, i)) if i else -1 for i in range(n)])
    perm = rng.permutation(n)
    inverse = np.argsort(perm)
    return np.array([inverse[parent[perm[j]]] if parent[perm[j]] >= 0 else -1 for j in range(n)])


def test_layout_matches_a_recursive_reference_and_the_budget_accounts_for_every_node():
    rng = np.random.default_rng(7)
    for _ in range(150):
        n = int(rng.integers(1, 80))
        parent = random_forest(rng, n, chains=rng.choice([0.0, 0.9]))  # unary paths are laid out compressed
        tokens, order = rng.integers(1, 20, n), rng.integers(0, 4, n)
        budget = int(rng.integers(0, n + 2))
        lay = layout_forest(parent, tokens, order, budget=budget)
        x, y, leaves = brute_layout(parent, tokens, order)
        assert lay.x.tolist() == [x[i] for i in range(n)]
        assert lay.y.tolist() == [y[i] for i in range(n)]
        assert lay.leaves.tolist() == [leaves[i] for i in range(n)]
        assert len(lay.drawn) == min(n, budget)
        assert len(lay.drawn) + int(lay.agg_count.sum()) == n  # every node drawn or counted once
        drawn = set(lay.drawn.tolist())
        assert all(parent[r] < 0 or parent[r] in drawn for r in drawn)  # whole subtrees are collapsed
        assert len(lay.agg_count) <= 2 * max(budget, 1) + 1


def test_layout_survives_parent_cycles_and_bad_rows():
    lay = layout_forest([1, 0, -1, 2, 7, 5], [1] * 6)  # 0 <-> 1 cycle, 4 -> out of range, 5 -> itself
    assert lay.cut == 2 and len(lay.drawn) == 6 and lay.height == 5
    lay = layout_forest([1, 2, 0, 0, 3], [4] * 5)  # a cycle through a branching node
    assert lay.cut == 5 and len(lay.drawn) + int(lay.agg_count.sum()) == 5


def test_subtree_and_subset():
    parent = np.array([-1, 0, 0, 1, 3, -1, 5])
    assert sorted(subtree(parent, 1).tolist()) == [1, 3, 4] and subtree(parent, 9).size == 0
    assert sorted(subtree([1, 2, 0], 0).tolist()) == [0, 1, 2]  # a cycle ends
    rows = ForestRows.from_rows([ForestRow(k, p, 4, 0, f"text {k}") for k, p in
                                 (("a", None), ("b", "a"), ("c", "a"), ("d", "b"), ("e", "d"))],
                                [ColourClass("GPU", "#4fa3ff")])
    part = rows.subset(subtree(rows.parent, 1))
    assert part.parent.tolist() == [-1, 0, 1] and [part.key(i) for i in range(3)] == ["b", "d", "e"]
    assert part.describe(2) == "text e"


def test_a_million_rows_collapse_to_the_budget():
    n = 1_000_000
    parent = np.arange(-1, n - 1)
    parent[::500] = -1  # 2,000 chains of 500 blocks
    lay = layout_forest(parent, np.full(n, 16), budget=20_000)
    assert len(lay.drawn) == 20_000 and int(lay.agg_count.sum()) == n - 20_000
    assert lay.width == 500 * 16 and lay.height == 2_000


# --- the view on plain rows (what a server window would give it) ------------------------------------------------
def test_the_forest_view_renders_plain_rows(qtbot):
    from pagevis.gui.widgets.prefix_forest import PrefixForestView

    classes = (ColourClass("RAM", "#4fa3ff"), ColourClass("disk", "#3ddc84"))
    rows = ForestRows.from_rows([ForestRow("a", None, 16, 0, "block a"), ForestRow("b", "a", 16, 0, "block b"),
                                 ForestRow("c", "a", 8, 1, "block c"), ForestRow("d", "gone", 16, 0, "d",
                                                                                 flags=REMOVED)], classes)
    view = PrefixForestView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    view.set_forest(rows)
    assert view.block_count == 3 and view.count_by_class() == {"RAM": 2, "disk": 1}
    assert rows.parent.tolist() == [-1, 0, 0, -1]
    center = view.center_of(view.row_of("c"))
    assert view.text_at(center.x(), center.y()) == (2, "block c")
    view.grab()  # paints


# --- the window on the recorded fixtures ------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def windows(qapp):
    """Every window a test opens, closed at its end (held here: a window collected while its threads run would
    destroy running QThreads); each must leave no thread running."""
    from pagevis.gui.widgets import theme

    theme.configure_pyqtgraph()
    opened = []
    yield opened
    for window in opened:
        window.close()
        assert not any(t.isRunning() for t in window.threads())


def show(qtbot, window, windows):
    windows.append(window)
    qtbot.addWidget(window)
    window.resize(1400, 900)
    window.show()
    window.start()
    return window


def open_recording(qtbot, windows, path, **kwargs):
    from pagevis.gui.attach.window import open_window

    return show(qtbot, open_window(playback=Playback(read_recording(path)), **kwargs), windows)


def goto(window, position):
    from pagevis.gui.attach.window import wait_for_position

    window.scrub(position)
    assert wait_for_position(window, position, WAIT_MS / 1000), f"the window never showed message {position}"


def reference(path, position):
    """The state's own snapshot at `position`, from a playback of its own (nothing shared with the window)."""
    playback = Playback(read_recording(path))
    playback.seek(position)
    return playback.fleet.snapshot().engines[0]


def resident_keys(engine):
    cols = engine.blocks
    return {(engine.tiers[t].medium, engine.tiers[t].group, cols.hashes[r])
            for r, t in enumerate(cols.tier.tolist()) if cols.resident[r]}


def shown_keys(window):
    rows = window.forest.rows
    return {rows.key(r) for r in range(len(rows)) if not rows.flags[r] & REMOVED}


@pytest.mark.parametrize("name", ["vllm-0.34.0", "sglang-0.5.23"])
def test_scrubbing_a_recording_shows_exactly_the_state(qtbot, windows, name):
    path = DATA / f"{name}.kvev"
    window = open_recording(qtbot, windows, path)
    for position in (7, 2, 3, 4, 5, 6, 0, 7):  # back and forth
        goto(window, position)
        want = reference(path, position)
        resident = {m: n for m, n in want.resident.items() if n}
        assert window.forest.block_count == sum(resident.values())
        assert window.forest.count_by_class() == resident
        assert shown_keys(window) == resident_keys(want)  # the very blocks, no more
        bars = window.plots.media_bars.opts
        assert dict(zip([t[1] for t in window.plots.media_plot.getAxis("left")._tickLevels[0]],
                        np.asarray(bars["width"]).tolist())) == dict(want.resident)
        assert window.frame.engine.counters.last_seq == want.counters.last_seq
    assert window.stop()


def test_hover_shows_hash_parent_tokens_medium_and_when_stored(qtbot, windows):
    path = DATA / "vllm-0.34.0.kvev"
    expected = json.loads((DATA / "vllm-0.34.0.expected.json").read_text())
    a, b = (next(r for r in expected["final"]["GPU"] if r["label"] == label) for label in "AB")
    window = open_recording(qtbot, windows, path)
    goto(window, 7)
    forest = window.forest
    forest.graphics.resize(900, 700)
    forest.plot.autoRange()
    qtbot.wait(50)
    row = forest.row_of(("GPU", None, b["hash"]))
    assert row >= 0
    qtbot.mouseMove(forest.graphics.viewport(), forest.widget_pos(forest.center_of(row)))
    qtbot.waitUntil(lambda: forest.hover_text.startswith(f"block {b['hash']}"), timeout=5000)
    text = forest.hover_text
    assert "(GPU)" in text and f"parent: {a['hash']}" in text
    assert "4 tokens: " + " ".join(map(str, b["tokens"])) in text
    stored = reference(path, 7).blocks
    slot = stored.hashes.index(b["hash"])
    assert f"stored by seq {int(stored.seq[slot])} at " in text
    root = forest.row_of(("GPU", None, a["hash"]))
    assert "parent: none" in forest.rows.describe(root)
    window._clicked(root)  # the details pane: the block and its prefix
    assert window.details.toPlainText().startswith(f"block {a['hash']}")
    assert "its prefix: 1 blocks, 4 tokens" in window.details.toPlainText()


def test_double_click_shows_a_subtree_and_the_button_the_whole_forest(qtbot, windows):
    path = DATA / "vllm-0.34.0.kvev"
    expected = json.loads((DATA / "vllm-0.34.0.expected.json").read_text())
    b = next(r for r in expected["final"]["GPU"] if r["label"] == "B")
    below_b = {r["hash"] for r in expected["final"]["GPU"] if r["parent"] == b["hash"]} | {b["hash"]}
    window = open_recording(qtbot, windows, path)
    goto(window, 7)
    forest = window.forest
    forest.plot.autoRange()
    qtbot.wait(50)
    center = forest.widget_pos(forest.center_of(forest.row_of(("GPU", None, b["hash"]))))
    qtbot.mouseDClick(forest.graphics.viewport(), Qt.LeftButton, pos=center)
    qtbot.mouseRelease(forest.graphics.viewport(), Qt.LeftButton, pos=center)  # pyqtgraph emits on the release
    qtbot.waitUntil(lambda: window.forest_frame.focus == ("GPU", None, b["hash"]), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: forest.block_count == len(below_b), timeout=WAIT_MS)
    assert shown_keys(window) == {("GPU", None, h) for h in below_b}
    assert window.show_all.isVisible()
    window._clicked(forest.row_of(("GPU", None, b["hash"])))  # details still walk the whole prefix
    assert "its prefix: 2 blocks, 8 tokens" in window.details.toPlainText()
    window.show_all.click()
    qtbot.waitUntil(lambda: window.forest_frame.focus is None and forest.block_count == 7, timeout=WAIT_MS)
    assert not window.show_all.isVisible()


@pytest.mark.parametrize("name", ["vllm-0.34.0", "sglang-0.5.23"])
def test_a_removed_block_is_marked_then_gone(qtbot, windows, name):
    path = DATA / f"{name}.kvev"
    at = reference(path, 4)  # message 4 (seq 3) removes two blocks
    removed = {(r.medium, r.group, r.hash) for r in at.recent_removed if r.seq == 3}
    assert len(removed) == 2
    window = open_recording(qtbot, windows, path)
    goto(window, 3)
    goto(window, 4)
    rows = window.forest.rows
    marked = {rows.key(r) for r in range(len(rows)) if rows.flags[r] & REMOVED}
    assert marked == removed
    assert not removed & shown_keys(window)
    goto(window, 5)
    rows = window.forest.rows
    assert not any(rows.flags & REMOVED) or {rows.key(r) for r in range(len(rows)) if rows.flags[r] & REMOVED} \
        .isdisjoint(removed)
    still = resident_keys(reference(path, 5))
    assert {rows.key(r) for r in range(len(rows))} & removed == removed & still  # gone unless stored again


def test_decode_errors_are_counted_and_shown_and_good_batches_keep_applying(qtbot, windows, tmp_path):
    path = tmp_path / "hostile.kvev"
    good = [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                        medium="GPU")]
    with Recorder(path, ["e"], {"topic": TOPIC}) as recorder:
        recorder.write(LIVE, 0, 0.0, [b"kv-events", (0).to_bytes(8, "big"), encode_batch(1.0, good)])
        recorder.write(LIVE, 0, 0.0, [b"kv-events", b"\x00\x01"])  # two frames
        recorder.write(LIVE, 0, 0.0, [b"kv-events", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        recorder.write(LIVE, 0, 0.0, [b"kv-events", (2).to_bytes(8, "big"),
                                      encode_batch(2.0, [BlockRemoved(block_hashes=[2], medium="GPU")])])
    window = open_recording(qtbot, windows, path)
    goto(window, 4)
    assert window.forest.block_count == 1
    qtbot.waitUntil(lambda: window.errors.isVisible(), timeout=5000)
    assert window.errors.text().startswith("decode errors: 2 (last, e: ")
    assert window.frame.engine.counters.decode_errors == 2


# --- live, over real ZMQ sockets --------------------------------------------------------------------------------
def stored(hashes, parent=None, size=2):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, block_size=size, medium="GPU",
                       token_ids=[h * 10 + i for h in hashes for i in range(size)])


@pytest.fixture
def publishers():
    from pagevis.attach.publisher import KVEventPublisher

    made = []

    def make():
        made.append(KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC))
        return made[-1]
    yield make
    for publisher in made:
        publisher.close()


def open_live(qtbot, windows, pubs, **kwargs):
    from pagevis.attach.subscriber import Source
    from pagevis.gui.attach.window import open_window

    window = show(qtbot, open_window(sources=[Source(p.endpoint, p.replay_endpoint, TOPIC) for p in pubs], **kwargs),
                  windows)
    qtbot.waitUntil(lambda: window.frame is not None and window.frame.started, timeout=WAIT_MS)
    return window


def shown(window, engine=0):
    """(resident per medium in the window's fleet frame, blocks in its forest), once both are for `engine`."""
    frame, forest = window.frame, window.forest_frame
    if frame is None or forest is None or frame.selected != engine or forest.selected != engine:
        return None
    return dict(frame.engine.resident), window.forest.block_count


def test_live_counts_follow_the_stream_and_closing_stops_every_thread(qtbot, windows, publishers, tmp_path):
    pub = publishers()
    pub.publish([stored([1, 2, 3])], ts=1.0)  # before the attach: rebuilt from the replay endpoint
    window = open_live(qtbot, windows, [pub], record=str(tmp_path / "live.kvev"))
    qtbot.waitUntil(lambda: shown(window) == ({"GPU": 3}, 3), timeout=WAIT_MS)
    assert "rebuilt from 1 replayed batches (the whole history)" in window.status.text()
    time.sleep(0.3)  # the subscription reaches the PUB socket
    for k in range(20):
        pub.publish([stored([100 + k], parent=3 if k == 0 else 99 + k)], ts=2.0 + k)
    qtbot.waitUntil(lambda: shown(window) == ({"GPU": 23}, 23), timeout=WAIT_MS)
    pub.publish([BlockRemoved(block_hashes=[110 + k for k in range(10)], medium="GPU")], ts=30.0)
    qtbot.waitUntil(lambda: shown(window) == ({"GPU": 13}, 13), timeout=WAIT_MS)
    assert window.frame.engine.counters.last_seq == 21
    threads = window.threads()
    assert all(t.isRunning() for t in threads)
    window.close()
    assert all(t.isFinished() and not t.isRunning() for t in threads)
    assert window.source.attacher._sockets == []  # closed on the worker's own thread
    recording = read_recording(tmp_path / "live.kvev")
    assert sum(r.kind == LIVE for r in recording.records) == 21
    assert recording.meta == {"replays": [pub.replay_endpoint], "topic": TOPIC}


def test_two_engines_their_overlap_and_the_engine_selector(qtbot, windows, publishers):
    a, b = publishers(), publishers()
    a.publish([stored([1, 2, 3])], ts=1.0)
    b.publish([stored([1, 2, 4])], ts=1.0)
    b.publish([stored([5])], ts=2.0)
    window = open_live(qtbot, windows, [a, b])
    qtbot.waitUntil(lambda: shown(window) == ({"GPU": 3}, 3) and window.frame.shared_blocks == 2, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: window.forest_frame.overlap.pairwise is not None, timeout=WAIT_MS)
    table = window.forest_frame.overlap
    assert table.gpu == (3, 4) and table.held_elsewhere == (2, 2) and table.pairwise.tolist() == [[3, 2], [2, 4]]
    rows = window.forest.rows
    assert {rows.key(r)[2] for r in range(len(rows)) if rows.flags[r] & SHARED} == {1, 2}
    window.engine_box.setCurrentIndex(1)
    qtbot.waitUntil(lambda: shown(window, 1) == ({"GPU": 4}, 4), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: window.engines_table.rowCount() == 2
                    and window.engines_table.item(1, 5).text() == "2 of 4", timeout=WAIT_MS)
    window.close()
    assert not any(t.isRunning() for t in window.threads())


VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0"} %d
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0"} %d
"""


def test_metrics_are_plotted_beside_the_events(qtbot, windows, publishers):
    scrapes = []

    def body():
        scrapes.append(1)
        return VLLM_METRICS % (100 * len(scrapes), 75 * len(scrapes))

    with metrics_endpoint(body) as url:
        window = open_live(qtbot, windows, [publishers()], metrics_url=url)
        window.metrics_worker.interval_s = 0.1
        qtbot.waitUntil(lambda: len(window.plots.metrics.hit_curve.getData()[1] if window.plots.metrics.hit_curve.getData()[1] is not None
                                    else []) >= 2, timeout=WAIT_MS)
        assert window.plots.metrics.requests_plot.isVisible()
        assert set(window.plots.metrics.running_curve.getData()[1]) == {3.0} and set(window.plots.metrics.usage_curve.getData()[1]) == {25.0}
        assert set(window.plots.metrics.hit_curve.getData()[1]) == {75.0}
        window.close()


def test_a_bad_endpoint_or_metrics_url_is_shown_not_raised(qtbot, windows):
    from pagevis.attach.subscriber import Source
    from pagevis.gui.attach.window import open_window

    window = show(qtbot, open_window(sources=[Source("tcp://no-port-here")], metrics_url="http://127.0.0.1:9/metrics"),
                  windows)
    qtbot.waitUntil(lambda: "could not attach" in window.errors.text() and "--metrics" in window.errors.text(),
                    timeout=WAIT_MS)
    window.close()
    assert not any(t.isRunning() for t in window.threads())


def test_the_cli_opens_this_window_with_its_arguments(monkeypatch, tmp_path):
    from pagevis.cli.main import main
    from pagevis.gui.attach import window as attach_window

    calls = []
    monkeypatch.setattr(attach_window, "launch", lambda **kwargs: calls.append(kwargs) or 0)
    assert main(["attach", "--play", str(DATA / "vllm-0.34.0.kvev")]) == 0
    (kwargs,) = calls
    assert set(kwargs) == {"sources", "playback", "detokenizer", "metrics_url", "record", "tokenizer"}
    assert len(kwargs["playback"]) == 7 and kwargs["sources"] == []

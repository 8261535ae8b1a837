"""The sequences window, driven for real (offscreen): shared pages with their ref counts, copy-on-write,
block tables side by side, the cached free queue, the memory panel, and fork from a recorded step."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import CONFIG, PROMPT, make_window  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from pagevis.gui.sequences.view import page_cells  # noqa: E402

SEQ_CONFIG = replace(CONFIG, max_pages=12, policy="none", max_new_tokens=8)  # 17-token prompt: 4 full pages + 1


def step(qtbot, seqs, click: bool = False):
    """One step in the window's worker thread, waited for."""
    count = len(seqs.records)
    if click:
        qtbot.mouseClick(seqs.step_button, Qt.LeftButton)
    else:
        seqs.step()
    qtbot.waitUntil(lambda: not seqs.busy, timeout=120_000)
    return len(seqs.records) > count


def sequences_window(qtbot, tmp_path, config=SEQ_CONFIG, **window):
    main = make_window(qtbot, tmp_path, config=config, **window)
    seqs = main.open_sequences()
    assert seqs is not None
    qtbot.addWidget(seqs)
    if config is SEQ_CONFIG:
        seqs.new_tokens.setValue(SEQ_CONFIG.max_new_tokens)
    return seqs


def test_at_its_defaults_sharing_saves_pages_and_contiguous_reserves_more(qtbot, tmp_path):
    from pagevis.engine import ModelSpec
    from pagevis.kvcache import EventKind
    from pagevis.presets import DEFAULT_CONFIG, default_prompt

    # the app's default cache (sinks, 12 pages of 8: a sequence evicts past 96 tokens) and the synthetic model
    seqs = sequences_window(qtbot, tmp_path, config=DEFAULT_CONFIG, spec=ModelSpec(kind="synthetic"),
                            prompt=default_prompt("synthetic"))
    assert seqs.n.value() == 4 and seqs.new_tokens.value() == 128
    seqs.start()
    prompt, size = seqs.prompt_tokens, DEFAULT_CONFIG.page_size
    for _ in range(60):  # past the main window's 96-token cap: the window's own cache evicts nothing
        assert step(qtbot, seqs)
    record = seqs.view.record
    assert len(record.n_cached) == 4 and not any(e.kind is EventKind.EVICT for r in seqs.records for e in r.events)
    pages = {s: -(-n // size) for s, n in record.n_cached.items()}  # each sequence's pages, from its tokens
    full = prompt // size  # the prompt's full pages, stored once
    expected = (("paged, shared", full + sum(p - full for p in pages.values())),
                ("paged, no sharing", sum(pages.values())),
                ("contiguous reservation", -(-4 * (prompt + 128) // size)))
    assert seqs.view.memory.rows == expected
    shared, unshared, contiguous = (pages for _, pages in expected)
    assert shared < unshared < contiguous and unshared - shared == 3 * full
    assert seqs.view.memory.peaks == expected  # nothing has finished: the peaks are now


def test_parallel_samples_share_the_prompt_pages_then_copy_on_write(qtbot, tmp_path):
    seqs = sequences_window(qtbot, tmp_path)
    seqs.n.setValue(3)
    qtbot.mouseClick(seqs.start_button, Qt.LeftButton)
    step(qtbot, seqs, click=True)  # prefill once, fork 3 samples
    cells = page_cells(seqs.view.record)
    shared = [c for c in cells if c.state == "shared"]
    assert len(shared) == 5 and all(c.ref_count == 3 and c.owners == (0, 1, 2) for c in shared)
    assert seqs.view.tables.columnCount() == 3 and seqs.view.tables.item(0, 1).text() == "0 ×3"
    step(qtbot, seqs, click=True)  # each writes its first token: the partial page is copied
    cells = page_cells(seqs.view.record)
    assert sum(c.state == "shared" for c in cells) == 4
    assert sum(c.state == "private" for c in cells) == 3
    assert "cow" in seqs.status.text()
    assert seqs.view.memory.rows[0] == ("paged, shared", 7) and seqs.view.memory.rows[1][1] == 15
    assert seqs.view.texts.columnCount() == 3


def test_fork_from_a_recorded_step_and_the_cached_queue(qtbot, tmp_path):
    seqs = sequences_window(qtbot, tmp_path)
    seqs.n.setValue(1)
    seqs.start()
    for _ in range(4):
        assert step(qtbot, seqs)
    child = seqs.fork(0, 1, seed=7)  # as after step 1: prompt + 1 generated token
    assert child == 1
    step(qtbot, seqs)
    tables = seqs.view.record.block_tables
    assert tables[1][:4] == tables[0][:4]  # the child reads the parent's full pages
    assert all(c.ref_count == 2 for c in page_cells(seqs.view.record) if c.page in tables[0][:4])
    while not seqs.batch.done:
        step(qtbot, seqs)
    assert not step(qtbot, seqs)
    assert "finished" in seqs.status.text()
    last = seqs.view.record
    assert not last.block_tables and len(last.cached_free) >= 4
    assert "cached free queue" in seqs.view.queue.text()
    assert seqs.fork(0, len(seqs.records) - 1, seed=8) == 2  # a finished parent: through the prefix cache
    step(qtbot, seqs)
    assert seqs.batch.cache.prefix_stats.hits >= 16
    seqs.resize(1200, 800)
    seqs.show()
    qtbot.waitExposed(seqs)
    seqs.grab().save(str(tmp_path / "sequences.png"))


def test_sequences_view_needs_a_model_and_reports_a_small_pool(qtbot, tmp_path):
    from pagevis.gui.session.window import MainWindow

    window = MainWindow(restore=False, persist=False)
    qtbot.addWidget(window)
    assert window.open_sequences() is None
    assert "Load a model first" in window.statusBar().currentMessage()
    seqs = sequences_window(qtbot, tmp_path)
    seqs.pool_pages.setValue(2)
    seqs.start()
    assert not step(qtbot, seqs)
    assert "pool of 2 pages" in seqs.status.text()
    assert PROMPT


def test_run_decodes_every_sequence_to_the_end_in_the_worker(qtbot, tmp_path):
    seqs = sequences_window(qtbot, tmp_path)
    seqs.n.setValue(2)
    seqs.start()
    seqs.run_button.setChecked(True)
    qtbot.waitUntil(lambda: "finished" in seqs.status.text(), timeout=60000)
    assert not seqs.run_button.isChecked() and not seqs.busy
    assert len(seqs.records) == SEQ_CONFIG.max_new_tokens
    assert all(len(s.generated) == SEQ_CONFIG.max_new_tokens for s in seqs.batch.requests.values())
    assert seqs.view.texts.columnCount() == 2

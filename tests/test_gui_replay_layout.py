"""A replay shows the recorded model's head layout and cache size (the trace's kv_layout header), whatever the
model (a GGUF's spec says nothing of its heads), and an older trace without them replays as 'unknown'."""

from __future__ import annotations

import json
import zipfile

import pytest

pytest.importorskip("pytestqt")
from gui_helpers import CONFIG, PROMPT, SYNTH, make_window, step  # noqa: E402

# the live window's line for this cache (test_gui_demo checks it against the byte count)
MEMORY = "K/V 8 KiB = 2 KV heads × 4 KiB · float32, 4.1 kbit per token"


def synthetic_trace(tmp_path, name="run.pvtrace"):
    """A trace whose model spec is not saved, as for a GGUF model: only kv_layout can tell the heads."""
    from pagevis.engine import DecodeSession
    from pagevis.trace import write_trace

    session = DecodeSession(SYNTH.load(), PROMPT, CONFIG)
    for _ in range(4):
        session.step()
    path = tmp_path / name
    write_trace(path, session)
    return path


def rewrite_header(path, change) -> None:
    """The trace with its header.json changed by `change(header)` (the arrays as they were)."""
    with zipfile.ZipFile(path) as old:
        members = {info.filename: old.read(info) for info in old.infolist()}
    header = json.loads(members["header.json"])
    change(header)
    members["header.json"] = json.dumps(header).encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as new:
        for name, data in members.items():
            new.writestr(name, data)


def test_a_replay_shows_the_head_layout_and_cache_size_without_a_model_spec(qtbot, tmp_path):
    path = synthetic_trace(tmp_path)
    window = make_window(qtbot, tmp_path)
    assert window.status_memory.text() == MEMORY  # live
    assert window.open_trace(str(path))
    window.docks["Heads"].raise_()
    window.scrub(3)
    qtbot.waitUntil(lambda: "2 KV heads" in window.heads.layout_label.text(), timeout=3000)
    assert window.heads.layout_label.text().startswith("4 query heads → 2 KV heads (grouped-query")
    assert window.status_memory.text() == MEMORY
    assert window.controls.head.itemText(3) == "head 2 (KV 1)"


def test_a_trace_saved_by_the_app_carries_the_layout(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    step(qtbot, window, 3)
    path = window.files.save_trace(str(tmp_path / "saved.pvtrace"))
    assert path and window.open_trace(path)
    assert window.status_memory.text() == MEMORY
    assert window.timeline.info.n_kv_heads == 2 and window.timeline.info.storage


def test_an_older_trace_without_the_layout_replays_as_unknown(qtbot, tmp_path):
    path = synthetic_trace(tmp_path)
    rewrite_header(path, lambda header: header.pop("kv_layout"))
    window = make_window(qtbot, tmp_path)
    assert window.open_trace(str(path))
    window.docks["Heads"].raise_()
    window.scrub(3)
    qtbot.waitUntil(lambda: "query heads" in window.heads.layout_label.text(), timeout=3000)
    assert window.heads.layout_label.text() == "4 query heads (KV layout unknown)"
    assert window.status_memory.text() == "K/V —"
    assert len(window.timeline) == 4


@pytest.mark.parametrize("layout, message", [
    ({"n_heads": 4, "n_kv_heads": 3}, "4 query heads over 3 KV heads"),
    ({"n_kv_heads": "2"}, "kv_layout n_kv_heads = '2' is not a int"),
    ({"cache_bytes": -1}, "sizes are out of range"),
])
def test_a_bad_layout_is_a_one_line_trace_error(tmp_path, layout, message):
    from pagevis.trace import TraceError, read_trace

    path = synthetic_trace(tmp_path)
    rewrite_header(path, lambda header: header["kv_layout"].update(layout))
    with pytest.raises(TraceError, match=message) as error:
        read_trace(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)

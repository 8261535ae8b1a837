"""The HTML page of a session (pagevis.export.html): the embedded changes rebuild every step's page grid
exactly; in a real headless Chromium (Debian's `chromium`), the page scrubbed by its URL shows that step's
grid, narration, text and evictions; bad requests are one-line errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from pagevis.cli.main import main
from pagevis.export.html import page_data, render
from pagevis.viewmodel.cells import cell_states
from pagevis.viewmodel.narration import narrate
from pagevis.viewmodel.timeline import timeline_from_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from pagevis.trace import read_trace
    from tests.gui_helpers import write_synthetic_trace

    path, _ = write_synthetic_trace(tmp_path_factory.mktemp("html"), 12)
    return path, read_trace(path)


def rebuild(data, index):
    """The grid at step `index` from the page's changes, applied as the page's script applies them."""
    states = np.zeros(data["pages"] * data["slots"], np.int64)
    positions = np.full(data["pages"] * data["slots"], -1, np.int64)
    for changes in data["cells"][:index + 1]:
        c = np.asarray(changes, np.int64).reshape(-1, 3)
        states[c[:, 0]], positions[c[:, 0]] = c[:, 1], c[:, 2]
    return states, positions


@pytest.mark.parametrize("layer", [0, 1])
def test_the_changes_rebuild_every_steps_grid_narration_and_evictions(trace, layer):
    timeline = timeline_from_trace(trace[1])
    data = page_data(timeline, layer)
    assert len(data["steps"]) == len(timeline) == 12
    for i, record in enumerate(timeline.records):
        states, positions = rebuild(data, i)
        np.testing.assert_array_equal(states, cell_states(record, layer).ravel())
        np.testing.assert_array_equal(positions, record.slot_maps[layer].ravel())
        assert data["narration"][i] == narrate(record, layer, timeline.position_text, timeline.info.config.policy)
    evicted = [(e.step, e.page, e.slot, e.position) for e in timeline.evictions if e.layer == layer]
    assert [(data["steps"][i][0], *e[:3]) for i, step in enumerate(data["events"]) for e in step] == evicted
    assert "".join(data["tokens"]) == "".join(timeline.position_text(p) for p in range(len(timeline.token_ids)))


def test_decode_steps_cost_a_few_hundred_bytes_and_no_text_closes_the_script(trace):
    timeline = timeline_from_trace(trace[1])
    data = page_data(timeline)
    decode = [json.dumps([data["cells"][i], data["narration"][i], data["events"][i], data["steps"][i]])
              for i, s in enumerate(data["steps"]) if s[1] == 1]
    assert decode and max(len(d) for d in decode) < 400
    data["tokens"][0] = "</script><b>"
    page = render(data)
    assert page.count("</script>") == 2 and "<\\/script><b>" in page


def test_replay_html_bad_layer_and_unwritable_path_are_one_line_errors(trace, tmp_path, capsys):
    path = str(trace[0])
    assert main(["replay", path, "--html", str(tmp_path / "p.html"), "--layer", "5"]) == 2
    err = capsys.readouterr().err
    assert "--html" in err and "layer 5: the session has layers 0 to 1" in err and err.count("\n") == 1
    assert main(["replay", path, "--html", str(tmp_path / "nowhere" / "p.html")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["replay", path, "--html", str(tmp_path / "p.htm")]) == 2
    assert "give a name ending in .html" in capsys.readouterr().err


def dump_dom(page, step: int, tmp_path) -> str:
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                           f"file://{page}#step={step}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-500:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_chromium_scrubbed_by_the_url_shows_that_steps_grid_text_and_evictions(trace, tmp_path):
    import html as html_module

    path, loaded = trace
    page = tmp_path / "session.html"
    assert main(["replay", str(path), "--html", str(page)]) == 0
    timeline = timeline_from_trace(loaded)
    step = 7
    dom = dump_dom(page, step, tmp_path)
    record = timeline.record(step)
    cells = re.findall(r'<div class="cell"[^>]*>(-?\d*)</div>', dom)
    expected = [str(p) if p >= 0 else "" for p in record.slot_maps[0].ravel()]
    assert cells == expected
    narration = re.search(r'<div id="narration">(.*?)</div>', dom).group(1)
    assert html_module.unescape(narration) == narrate(record, 0, timeline.position_text, "sinks")
    assert f"step {record.step} / {timeline.record(-1).step}" in dom
    evictions = [e for e in timeline.evictions if e.layer == 0 and e.step <= record.step]
    rows = re.findall(r"<tr[^>]*><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>", body(dom, "events"))
    assert f"{len(evictions)} up to this step" in dom
    assert rows == [tuple(str(v) for v in (e.step, e.page, e.slot, e.position)) for e in reversed(evictions)]
    shown = re.findall(r'<span title="position (\d+)"( hidden="")?', dom)
    assert sum(1 for _, hidden in shown if not hidden) == timeline.n_positions(step)
    first = dump_dom(page, 0, tmp_path)
    assert body(first, "events") == "" and "step 0:" in first


def body(dom: str, element_id: str) -> str:
    return re.search(rf'<tbody id="{element_id}">(.*?)</tbody>', dom, re.S).group(1)


def test_file_menu_export_html(qtbot, tmp_path):
    from tests.gui_helpers import make_window

    window = make_window(qtbot, tmp_path)
    assert window.export_html(str(tmp_path / "none.html")) is None  # no steps yet
    window.runner.step_blocking(3)
    window.controls.layer.setValue(1)
    window.scrub(2)
    out = tmp_path / "menu.html"
    assert window.export_html(str(out)) == str(out)
    text = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
                      .group(1).replace("<\\/", "</"))
    assert data["layer"] == 1 and len(data["steps"]) == 3
    assert data["narration"][2] == window.narration.text()

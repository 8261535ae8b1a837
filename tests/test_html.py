"""The HTML page of a session (pagevis.export.html): the embedded changes rebuild every step's page grid
exactly; in a real headless Chromium (Debian's `chromium`), the page scrubbed by its URL shows that step's
grid, narration, text and evictions, and its keys and slider move it; bad requests are one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

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
    assert "--layer 5: must be from 0 to 1" in err and err.count("\n") == 1
    assert main(["replay", path, "--html", str(tmp_path / "nowhere" / "p.html")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["replay", path, "--html", str(tmp_path / "p.htm")]) == 2
    assert "give a name ending in .html" in capsys.readouterr().err


def body(dom: str, element_id: str) -> str:
    return re.search(rf'<tbody id="{element_id}">(.*?)</tbody>', dom, re.S).group(1)


def test_file_menu_export_html(qtbot, tmp_path):
    from tests.gui_helpers import make_window

    window = make_window(qtbot, tmp_path)
    assert window.files.export_html(str(tmp_path / "none.html")) is None  # no steps yet
    window.runner.step_blocking(3)
    window.controls.layer.setValue(1)
    window.scrub(2)
    out = tmp_path / "menu.html"
    assert window.files.export_html(str(out)) == str(out)
    text = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
                      .group(1).replace("<\\/", "</"))
    assert data["layer"] == 1 and len(data["steps"]) == 3
    assert data["narration"][2] == window.narration.text()


class DevTools:
    """Chromium driven over --remote-debugging-pipe (the DevTools protocol, JSON messages ending in a NUL byte on
    fds 3 and 4): a page at a URL, keys pressed, expressions evaluated. No package beyond the browser."""

    def __init__(self, url: str, profile):
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def pipes():  # the child's fds 3 (commands in) and 4 (replies out)
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        self.process = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", url],
                                        preexec_fn=pipes, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buffer, self._id, self.session = b"", 0, None
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def call(self, method: str, **params):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session and method.split(".")[0] not in ("Target", "Browser"):
            message["sessionId"] = self.session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from, 1 << 16)
                assert chunk, "chromium closed the pipe"
                self._buffer += chunk
            raw, _, self._buffer = self._buffer.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]
        raise TimeoutError(method)

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 20):
        deadline = time.monotonic() + seconds
        while not self.js(expression):
            assert time.monotonic() < deadline, f"never true: {expression}"
            time.sleep(0.05)

    def press(self, *keys: str) -> None:
        for key in keys:
            for kind in ("keyDown", "keyUp"):
                self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key,
                          windowsVirtualKeyCode={"ArrowLeft": 37, "ArrowRight": 39, "Home": 36, "End": 35}[key])

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self._to)
            os.close(self._from)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_chromium_shows_each_step_scrubbed_by_keys_slider_and_url(trace, tmp_path):
    path, loaded = trace
    page = tmp_path / "keys.html"
    assert main(["replay", str(path), "--html", str(page)]) == 0
    timeline = timeline_from_trace(loaded)
    said = [narrate(r, 0, timeline.position_text, "sinks") for r in timeline.records]
    browser = DevTools(f"file://{page}#step=2", tmp_path / "profile")
    try:
        narration = "document.getElementById('narration').textContent"
        browser.wait_for(f"document.getElementById('narration') && {narration}")
        assert browser.js(narration) == said[2]
        browser.press("ArrowRight", "ArrowRight", "ArrowLeft")
        assert browser.js("location.hash") == "#step=3" and browser.js(narration) == said[3]
        browser.press("End")
        assert browser.js(narration) == said[-1] and browser.js("document.getElementById('slider').value") == "11"
        browser.press("Home")
        assert browser.js(narration) == said[0]
        browser.js("const s = document.getElementById('slider'); s.value = 5; s.dispatchEvent(new Event('input'))")
        assert browser.js("location.hash") == "#step=5" and browser.js(narration) == said[5]
        cells = browser.js("[...document.querySelectorAll('#grid .cell')].map(c => c.textContent)")
        assert cells == [str(p) if p >= 0 else "" for p in timeline.record(5).slot_maps[0].ravel()]
        browser.js("location.hash = '#step=7'")  # a link to a step, followed in the open page
        browser.wait_for("document.getElementById('slider').value === '7'")
        check_dom(browser.js("document.documentElement.outerHTML"), timeline, 7)
        browser.press("Home")
        assert body(browser.js("document.documentElement.outerHTML"), "events") == ""
    finally:
        browser.close()


def check_dom(dom: str, timeline, step: int) -> None:
    """The page as drawn at `step` against the timeline: the grid's cells, the narration, the step, the eviction
    rows (newest first) and the text shown so far."""
    import html as html_module

    record = timeline.record(step)
    cells = re.findall(r'<div class="cell"[^>]*>(-?\d*)</div>', dom)
    assert cells == [str(p) if p >= 0 else "" for p in record.slot_maps[0].ravel()]
    narration = re.search(r'<div id="narration">(.*?)</div>', dom).group(1)
    assert html_module.unescape(narration) == narrate(record, 0, timeline.position_text, "sinks")
    assert f"step {record.step} / {timeline.record(-1).step}" in dom
    evictions = [e for e in timeline.evictions if e.layer == 0 and e.step <= record.step]
    rows = re.findall(r"<tr[^>]*><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>", body(dom, "events"))
    assert f"{len(evictions)} up to this step" in dom
    assert rows == [tuple(str(v) for v in (e.step, e.page, e.slot, e.position)) for e in reversed(evictions)]
    spans = re.findall(r'<span title="position \d+"[^>]*>', dom)
    assert len(spans) == len(timeline.token_ids)
    assert sum(1 for tag in spans if " hidden" not in tag) == timeline.n_positions(step)

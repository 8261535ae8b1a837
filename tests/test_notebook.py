"""What the API shows in a notebook: many inline views in one page, each its own (in headless Chromium: keys move
only the focused one, its grid is the trace's); the live widget (the pagevis[notebook] extra) steps, switches
layer and policy, refuses a bad layer, and carries the static view for where widgets do not render; the shipped
notebooks assert what they show (`make notebooks` runs them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import pagevis
from tests.test_html import CHROMIUM, DevTools

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from tests.gui_helpers import write_synthetic_trace

    path, _ = write_synthetic_trace(tmp_path_factory.mktemp("notebook"), 12)
    return pagevis.load_trace(path)


def prefix_of(fragment: str) -> str:
    return re.search(r'<div class="pagevis-view" id="([\w-]+)root"', fragment).group(1)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_two_views_in_one_page_each_scrub_their_own_grid(trace, tmp_path):
    a, b = trace.view(layer=0).html, trace.view(layer=1, step=4).html
    pa, pb = prefix_of(a), prefix_of(b)
    assert pa != pb
    page = tmp_path / "two.html"
    page.write_text(f"<!DOCTYPE html><html><body>{a}<p>between</p>{b}</body></html>", encoding="utf-8")
    browser = DevTools(f"file://{page}", tmp_path / "profile")
    try:
        slider = "document.getElementById('{}slider').value"
        browser.wait_for(f"document.getElementById('{pb}slider') && {slider.format(pb)} === '4'")
        assert browser.js(slider.format(pa)) == "11"  # a view opens at its last step unless told
        browser.js(f"document.getElementById('{pa}root').focus()")
        browser.press("ArrowLeft", "ArrowLeft", "ArrowLeft")
        assert browser.js(slider.format(pa)) == "8" and browser.js(slider.format(pb)) == "4"
        cells = browser.js(f"[...document.querySelectorAll('#{pa}grid .cell')].map(c => c.textContent)")
        assert cells == [str(p) if p >= 0 else "" for p in trace.positions(8, 0).ravel()]
        cells = browser.js(f"[...document.querySelectorAll('#{pb}grid .cell')].map(c => c.textContent)")
        assert cells == [str(p) if p >= 0 else "" for p in trace.positions(4, 1).ravel()]
        assert browser.js("location.hash") == ""  # only the exported page writes its step in the address
    finally:
        browser.close()


def test_the_widget_steps_switches_layer_and_policy_and_keeps_a_static_view():
    pytest.importorskip("anywidget")
    session = pagevis.Session(model="synthetic", policy="sinks", page_size=4, max_pages=4, max_new_tokens=30)
    widget = session.widget()
    assert widget.status == "0 steps" and widget.layers == 4 and "sinks" in widget.policies
    for _ in range(12):
        widget._message(widget, {"action": "step"}, [])
    assert len(session) == 12 and widget.status == "12 steps"
    data = json.loads(re.search(r'id="[\w-]+data">(.*?)</script>', widget.html, re.S).group(1).replace("<\\/", "</"))
    assert data["layer"] == 0 and len(data["steps"]) == 12
    widget.layer = 2
    assert "Page grid · layer 2" in widget.html
    with pytest.raises(pagevis.ConfigError, match="a layer from 0 to 3"):
        widget.layer = 4
    assert widget.layer == 2
    widget.policy = "oldest"
    assert widget.session is not session and widget.session.config.policy == "oldest" and len(widget.session) == 12
    assert widget.session.positions(-1, 0)[0].tolist() != session.positions(-1, 0)[0].tolist()  # oldest drops the sinks
    bundle = widget._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "application/vnd.jupyter.widget-view+json" in data and "Page grid · layer 2" in data["text/html"]


def test_the_shipped_notebooks_assert_what_they_show_and_hold_no_outputs():
    notebooks = sorted(EXAMPLES.glob("*.ipynb"))
    assert [n.name[:3] for n in notebooks] == ["01-", "02-", "03-"]
    for path in notebooks:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), f"{path.name} holds outputs"
        asserts = sum("assert " in "".join(c["source"]) for c in code)
        assert asserts >= 2, f"{path.name}: {asserts} cells assert what they show"
        assert not any("except" in "".join(c["source"]) for c in code), f"{path.name}: a cell hides an error"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian: apt-get install chromium)")
def test_the_widgets_script_draws_the_view_and_asks_for_steps(tmp_path):
    """The widget's ES module in Chromium, given a stand-in for anywidget's model (get, set, on, send): it draws
    the view with the view's own script, its buttons send "step", Play asks again after each redraw."""
    import base64

    pytest.importorskip("anywidget")
    session = pagevis.Session(model="synthetic", policy="sinks", page_size=4, max_pages=4, max_new_tokens=30).step(6)
    widget = session.widget()
    state = {name: getattr(widget, name) for name in ("html", "layer", "layers", "policy", "policies", "playing",
                                                      "status", "interval_ms")}
    module = base64.b64encode(widget._esm.encode()).decode()
    inline = json.dumps(state).replace("</", "<\\/")  # no text in it ends the script block it sits in
    page = tmp_path / "widget.html"
    page.write_text(f"""<!DOCTYPE html><html><body><div id="w"></div><script type="module">
import widget from "data:text/javascript;base64,{module}";
const state = {inline}, handlers = {{}};
window.sent = [];
window.model = {{ get: (k) => state[k], send: (m) => window.sent.push(m), save_changes: () => {{}},
  set: (k, v) => {{ state[k] = v; (handlers["change:" + k] || []).forEach((f) => f()); }},
  on: (e, f) => (handlers[e] = handlers[e] || []).push(f) }};
widget.render({{ model: window.model, el: document.getElementById("w") }});
</script></body></html>""", encoding="utf-8")
    prefix = prefix_of(widget.html)
    browser = DevTools(f"file://{page}", tmp_path / "profile")
    try:
        browser.wait_for(f"document.querySelectorAll('#{prefix}text span[title]').length > 0")  # the view's script ran
        cells = browser.js(f"[...document.querySelectorAll('#{prefix}grid .cell')].map(c => c.textContent)")
        assert cells == [str(p) if p >= 0 else "" for p in session.positions(-1, 0).ravel()]
        browser.js("document.querySelector('#w button').click()")
        assert browser.js("JSON.stringify(window.sent)") == '[{"action":"step"}]'
        widget.step()
        again = prefix_of(widget.html)
        browser.js(f"window.model.set('html', {json.dumps(widget.html)})")
        browser.wait_for(f"document.querySelectorAll('#{again}text span[title]').length > 0")
        assert browser.js(f"document.getElementById('{prefix}root') === null")
        browser.js(f"window.model.set('status', {json.dumps(widget.status)})")  # its own message (JupyterLab)
        assert browser.js("document.querySelector('#w span').textContent") == "7 steps"
        browser.js("document.querySelectorAll('#w button')[1].click()")  # Play
        browser.wait_for("window.sent.length === 2")
        assert browser.js("window.model.get('playing')") is True
    finally:
        browser.close()

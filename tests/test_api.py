"""The public Python API (pagevis.Session, compare, load_trace, ConfigError) on the real SmolLM2: `import pagevis`
stays light; a session's token ids and first token are transformers' (tests/data), its records and grid agree
with its own step records and its inline view; a trace round-trips; the teacher-forced perplexity is compare's,
and the perplexity ordering holds; bad arguments are ConfigErrors with the command line's words."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import pagevis
from pagevis.viewmodel.cells import cell_token
from tests.model_fixtures import reference  # noqa: F401 (a fixture)

HEAVY = ("PySide6", "shiboken6", "pyqtgraph", "numba", "pagevis.model", "pagevis.engine", "pagevis.kvcache",
         "pagevis.notebook", "pagevis.cli")


def test_import_pagevis_loads_nothing_heavy_until_a_name_is_used():
    code = ("import sys, pagevis; before = sorted(m for m in sys.modules if m.startswith(%r)); "
            "pagevis.ConfigError; print(before, 'pagevis.notebook' in sys.modules, sorted(pagevis.__all__))")
    found = subprocess.run([sys.executable, "-c", code % (HEAVY,)], capture_output=True, text=True, check=True,
                           timeout=60).stdout
    assert found.strip() == "[] False ['ConfigError', 'Session', 'compare', 'load_trace']"
    loaded = subprocess.run([sys.executable, "-c", "import sys, pagevis; pagevis.Session; print(sorted(m for m in "
                             "sys.modules if m.split('.')[0] in ('PySide6', 'pyqtgraph', 'numba')))"],
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert loaded.strip() == "[]"
    with pytest.raises(AttributeError, match="no attribute 'Sesion'"):
        pagevis.Sesion  # noqa: B018


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(page_size=0), "page_size = 0 is not allowed: an integer from 1 to 4096"),
    (dict(policy="nope"), "policy = 'nope' is not allowed"),
    (dict(pagesize=8), "did you mean 'page_size'?"),
    (dict(temperature=-1.0), "sampling.temperature = -1.0 is not allowed: a number in (0, 10]"),
    (dict(policy_params="n_sink=4"), "a dict of the policy's parameters"),
    (dict(policy="sinks", policy_params={"n_sink": 999}), "sinks.n_sink"),
    (dict(model="/no/such/model.gguf"), "--model /no/such/model.gguf: no such file"),
    (dict(prompt="hi", teacher_forced="text"), "not both"),
    (dict(tokens=100), "given only with teacher_forced"),
    (dict(port=80), "port = 80 is not allowed"),
])
def test_bad_arguments_are_config_errors_with_the_command_lines_words(kwargs, words):
    with pytest.raises(pagevis.ConfigError) as caught:
        pagevis.Session(**kwargs)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert type(caught.value) is pagevis.ConfigError


@pytest.fixture(scope="module")
def session():
    from pagevis.model import set_blas_threads

    set_blas_threads(1)  # as the model tests run (tests/model_fixtures.py): a busy core slows spinning threads
    s = pagevis.Session(prompt="The capital of France is", chat=False, policy="sinks", page_size=4, max_pages=3,
                        max_new_tokens=14)
    yield s.run()
    s.close()


def test_a_session_reads_transformers_token_ids_and_decodes_their_top_token(session, reference):  # noqa: F811
    known = next(p for p in reference["prompts"] if p["text"] == "The capital of France is" and p["kind"] == "plain")
    assert list(session.prompt_ids) == known["ids"]
    assert session.record(0).next_token == known["top_ids"][0]  # greedy: the full cache's first choice
    assert session.done and session.stop_reason == "max_new_tokens" and len(session) == 14
    table = session.records
    columns = {name: np.asarray(table[name]) for name in ("step", "n_tokens", "first_position", "resident_tokens",
                                                          "evictions_total")}
    np.testing.assert_array_equal(columns["step"], np.arange(14))
    assert columns["n_tokens"][0] == 5 and (columns["n_tokens"][1:] == 1).all()
    np.testing.assert_array_equal(columns["first_position"][1:], np.arange(5, 18))
    assert columns["resident_tokens"].max() == 12 and columns["evictions_total"][-1] > 0


def test_the_grid_holds_each_position_the_evictions_left_and_the_view_shows_it(session):
    for step in (3, len(session) - 1):
        grid = session.positions(step, layer=1)
        record = session.record(step)
        written = record.positions[-1] + 1
        evicted = {e.position for r in session._records()[: step + 1] for e in r.events
                   if e.layer == 1 and e.kind.name == "EVICT"}
        held = sorted(int(p) for p in grid.ravel() if p >= 0)
        assert held == sorted(set(range(written)) - evicted)
    assert sorted(session.positions(-1, 0)[0]) == [0, 1, 2, 3]  # sinks keeps the first page
    page = session.view(layer=1)._repr_html_()
    data = json.loads(re.search(r'<script type="application/json" id="(pv[\w-]+)data">(.*?)</script>', page, re.S)
                      .group(2).replace("<\\/", "</"))
    assert data["layer"] == 1 and data["start"] == len(session) - 1 and len(data["steps"]) == len(session)
    drawn = re.findall(r'<div class="cell" style="background:[^"]+" data-token="([^"]*)">(-?\d*)</div>', page)
    texts = [(cell_token(session.token_text(session.prompt_ids[p] if p < 5 else session.record(p - 5).next_token))
              if p >= 0 else "", str(p) if p >= 0 else "") for p in session.positions(-1, 1).ravel()]
    assert [(html.unescape(token), shown) for token, shown in drawn] == texts  # without the script: position, text
    assert page != session.view(layer=1)._repr_html_()  # each output has ids of its own
    with pytest.raises(pagevis.ConfigError, match="layers 0 to 29"):
        session.view(layer=30)


def test_a_saved_trace_loads_with_the_same_records_and_view(session, tmp_path):
    path = tmp_path / "s.pvtrace"
    assert session.save(path) > 0
    trace = pagevis.load_trace(path)
    assert len(trace) == len(session) and trace.config == session.config
    for name in ("step", "next_token", "resident_tokens", "pages_used", "evictions", "evictions_total"):
        np.testing.assert_array_equal(np.asarray(trace.records[name]), np.asarray(session.records[name]))
    np.testing.assert_array_equal(trace.positions(5, 2), session.positions(5, 2))
    assert "Page grid · layer 0" in trace._repr_html_()
    with pytest.raises(pagevis.ConfigError, match="no such folder"):
        session.save(tmp_path / "nowhere" / "s.pvtrace")
    with pytest.raises(pagevis.ConfigError):
        pagevis.load_trace(tmp_path / "missing.pvtrace")


def test_teacher_forced_perplexity_is_compares_and_the_ordering_holds():
    text = "pride-and-prejudice-ch1"
    table = pagevis.compare(text, policies=["sinks", "oldest"], budgets=[32], tokens=64, page_size=16,
                            optimal=False)
    full, sinks, oldest = table.full_cache_ppl, table.ppl("sinks", 32), table.ppl("oldest", 32)
    assert full < sinks < oldest  # the StreamingLLM effect: dropping the first tokens costs the most
    forced = pagevis.Session(teacher_forced=text, tokens=64, policy="sinks", page_size=16, max_pages=2).run()
    assert len(forced.nll) == 63 and forced.perplexity == pytest.approx(sinks, rel=1e-6)
    assert np.asarray(forced.records["scored"]).sum() == 63
    long_text = "A text of its own, not the name of a shipped one. " * 60  # longer than a file name may be
    own = pagevis.Session(teacher_forced=long_text, tokens=12, policy="sinks", page_size=4, max_pages=2).run()
    assert len(own.nll) == 11 and list(own.prompt_ids) == own.model.tokenizer.encode(long_text)[:12]
    shown = table._repr_html_()
    assert "<svg" in shown and "<script" not in shown and f"{oldest:.3f}" in shown
    with pytest.raises(pagevis.ConfigError, match="--budgets: 40 is not a positive multiple of --page-size 16"):
        pagevis.compare(text, budgets=[40])
    with pytest.raises(KeyError, match="the budgets 32"):
        table.ppl("sinks", 64)

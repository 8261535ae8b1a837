"""The metrics module on its own: the step hook feeds it, it is served on its own port for `pagevis run` and
the app, it counts the disk tier's event kinds when they appear, and the core never imports the server."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from serve_fixtures import SYNTH
from test_serve_load import scrape, value

from pagevis.cli.main import main
from pagevis.engine import DecodeSession, SessionConfig
from pagevis.observe import Metrics, serve_metrics


def run_session(metrics: Metrics | None = None, **config) -> DecodeSession:
    session = DecodeSession(SYNTH.load(), "pages", SessionConfig(**{"page_size": 4, "max_pages": 3,
                                                                     "max_new_tokens": 10, "chat": False, **config}))
    if metrics is not None:
        metrics.observe(session)
    list(session.run())
    return session


def test_step_hooks_see_every_record_in_order():
    session = DecodeSession(SYNTH.load(), "abc", SessionConfig(max_new_tokens=5, chat=False))
    seen = []
    session.add_hook(seen.append)
    session.step()
    session.step()
    session.remove_hook(seen.append)
    session.step()
    assert seen == session.records[:2]


def test_metrics_equal_the_records_and_are_served_on_their_own_port():
    metrics = Metrics()
    session = run_session(metrics, policy="oldest")
    server = serve_metrics(metrics, 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = scrape(text)
    records = session.records
    assert value(samples, "pagevis_generation_tokens_total") == len(session.generated) == 10
    assert value(samples, "pagevis_prompt_tokens_total") == len(session.prompt_ids)
    decode = [r for r in records if r.kind == "decode"]
    assert value(samples, "pagevis_inter_token_latency_seconds_count") == len(decode)
    assert value(samples, "pagevis_inter_token_latency_seconds_sum") == pytest.approx(
        sum(r.timings["total"] for r in decode))
    first = next(i for i, r in enumerate(records) if r.next_token >= 0)
    assert value(samples, "pagevis_time_to_first_token_seconds_sum") == pytest.approx(
        sum(r.timings["total"] for r in records[: first + 1]))
    assert value(samples, "pagevis_evictions_total", policy="oldest") == records[-1].evictions_total > 0
    writes = sum(1 for r in records for e in r.events if e.kind.value == "write")
    assert value(samples, "pagevis_cache_events_total", kind="write") == writes
    assert value(samples, "pagevis_kv_cache_usage_ratio") == records[-1].resident_tokens / 12
    assert value(samples, "pagevis_active_sessions") == 1


def test_disk_tier_events_and_counts_are_counted():
    """The disk tier's fault_in events are page faults; its per-layer counts give the bytes moved and the
    pages read per tier (records carry them as `tiers`, with count(name) -> per-layer array)."""
    metrics = Metrics()
    session = DecodeSession(SYNTH.load(), "x", SessionConfig(page_size=4, max_pages=3, chat=False))
    observer = metrics.observe(session)

    def event(kind):
        return SimpleNamespace(kind=SimpleNamespace(value=kind), policy="")

    counts = {"hits": [5, 4], "faults": [3, 0], "swapped_out": [2, 0], "bytes_read": [3072, 0],
              "bytes_written": [1024, 0]}
    tiers = SimpleNamespace(count=lambda name: np.array(counts[name]))
    record = SimpleNamespace(kind="decode", token_ids=(1,), next_token=2, timings={"total": 0.01},
                             resident_tokens=3, events=[event("swap_out")] * 2 + [event("fault_in")] * 3,
                             tiers=tiers)
    observer(record)
    samples = scrape(_latest(metrics))
    assert value(samples, "pagevis_page_faults_total") == 3
    assert value(samples, "pagevis_cache_events_total", kind="swap_out") == 2
    assert value(samples, "pagevis_swapped_bytes_total", kind="swap_out") == 1024
    assert value(samples, "pagevis_swapped_bytes_total", kind="fault_in") == 3072
    assert value(samples, "pagevis_page_reads_total", tier="ram") == 9
    assert value(samples, "pagevis_page_reads_total", tier="disk") == 3
    observer.close()
    assert value(scrape(_latest(metrics)), "pagevis_active_sessions") == 0


def _latest(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_two_metrics_objects_do_not_collide():
    a, b = Metrics(), Metrics()
    run_session(a)
    assert value(scrape(_latest(b)), "pagevis_generation_tokens_total") == 0
    assert value(scrape(_latest(a)), "pagevis_generation_tokens_total") == 10


def test_run_refuses_a_bad_metrics_port(capsys):
    assert main(["run", "--model", "synthetic", "--max-tokens", "2", "--metrics-port", "70000", "--quiet"]) == 2
    assert "--metrics-port 70000" in capsys.readouterr().err


def test_run_serves_metrics_while_it_runs(capsys):
    assert main(["run", "--model", "synthetic", "--max-tokens", "3", "--metrics-port", "0", "--quiet"]) == 0
    assert "metrics: http://127.0.0.1:" in capsys.readouterr().err


def test_app_sessions_feed_metrics(qtbot):
    from pagevis.gui import _observe_sessions
    from pagevis.gui.session.window import MainWindow

    window = MainWindow(restore=False, persist=False)
    qtbot.addWidget(window)
    metrics = Metrics()
    _observe_sessions(window.runner, metrics)
    window.apply_arguments(SYNTH, "pages of keys", SessionConfig(page_size=4, max_pages=3, max_new_tokens=30))
    window.start(blocking=True)
    window.runner.step_blocking(12)
    session = window.runner.session
    samples = scrape(_latest(metrics))
    assert value(samples, "pagevis_steps_total", kind="prefill") + value(
        samples, "pagevis_steps_total", kind="decode") == len(session.records) == 12
    assert value(samples, "pagevis_generation_tokens_total") == len(session.generated)
    window.start(blocking=True)  # a new session replaces the old one in the active count
    assert value(scrape(_latest(metrics)), "pagevis_active_sessions") == 1
    window.runner.shutdown()


def test_core_never_imports_the_server_and_metrics_never_import_fastapi():
    code = ("import sys, pagevis.kvcache, pagevis.model, pagevis.engine, pagevis.observe, pagevis.cli.run; "
            "bad = [m for m in sys.modules if m.startswith(('fastapi', 'uvicorn', 'starlette', 'pagevis.serve.app'))]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

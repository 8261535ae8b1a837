"""The Server window and what it drives: seeded arrivals, the one engine serving them (continuous batching, the
prefix cache, preemption), A/B in lockstep on the same arrivals. The window is driven for real (offscreen) on
the small synthetic model with a fixed clock (each engine step 50 ms of server time), and after every step each
view is compared with the engine's own state and records: no view invents state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pagevis.engine import ModelSpec, RunControl, run
from pagevis.simserver.run import ServerConfig, ServerPair, ServerRun, side_configs
from pagevis.simserver.workload import ArrivalSchedule, WorkloadConfig, follow_up_id
from pagevis.kvcache import ConfigError, EventKind
from pagevis.presets import SERVER_PRESETS, ServerPreset, find_server_preset

SYNTH = ModelSpec(kind="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
SMALL = dict(system_words=12, question_words=6, document_words=60, message_words=8, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    from pagevis.model import set_blas_threads

    set_blas_threads(1)
    return SYNTH.load()


def preset(kind="chat", compare="", pool_pages=96, max_seqs=4, n=8, rate=240.0, **workload) -> ServerPreset:
    return ServerPreset("test", "", WorkloadConfig(kind=kind, rate_per_min=rate, n_requests=n, **{**SMALL, **workload}),
                        ServerConfig(pool_pages=pool_pages, max_seqs=max_seqs, step_seconds=0.05, token_budget=256,
                                     max_chunk=128), compare=compare, page_size=8, capacity=1024)


def sides(model, p: ServerPreset):
    schedule = ArrivalSchedule(p.workload, model)
    runs = [ServerRun(model, p.session_config(), config, schedule, side)
            for side, config in zip("AB", side_configs(p.server, p.compare))]
    return schedule, runs


# --- Qt-free: arrivals, the server, the pair ------------------------------------------------------------------

def test_arrivals_are_seeded_poisson_and_a_rate_change_applies_from_the_next(model):
    config = WorkloadConfig(n_requests=400, rate_per_min=60, **SMALL)
    first, again = ArrivalSchedule(config, model), ArrivalSchedule(config, model)
    times = np.array([first.get(i).time for i in range(400)])
    assert [again.get(i) for i in range(400)] == first.arrivals  # the same seed, the same requests
    assert first.get(400) is None
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert 0.85 < gaps.mean() < 1.15 and gaps.std() / gaps.mean() > 0.8  # exponential gaps of 1 s on average
    other = ArrivalSchedule(replace(config, seed=1), model)
    assert other.get(0).prompt_ids != first.get(0).prompt_ids or other.get(0).time != first.get(0).time
    changed = ArrivalSchedule(config, model)
    changed.get(9)
    changed.set_rate(6000)
    assert changed.get(9) == first.get(9) and changed.get(20).time - changed.get(10).time < 1.0
    with pytest.raises(ConfigError):
        WorkloadConfig(kind="nope")


def test_chat_prompts_share_the_system_prompt_and_follow_ups_extend_the_previous_turn(model):
    chat = ArrivalSchedule(WorkloadConfig(kind="chat", **SMALL), model)
    a, b = chat.get(0).prompt_ids, chat.get(1).prompt_ids
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > 80  # the template and the passage (bytes for the synthetic model)
    users = ArrivalSchedule(WorkloadConfig(kind="returning", n_requests=3, turns=2, **SMALL), model)
    turn = users.get(1)
    tokens = [*turn.prompt_ids, 65, 66]
    follow = users.follow_up(turn, tokens, ended_at=10.0)
    assert follow.prompt_ids[: len(tokens)] == tuple(tokens) and follow.turn == 2 and follow.time >= 10.0
    assert follow.id == follow_up_id(3, 1, 2) and users.follow_up(follow, follow.prompt_ids, 20.0) is None
    assert chat.follow_up(chat.get(0), a, 1.0) is None


def test_the_server_serves_every_request_and_its_numbers_are_the_engines(model):
    _, (server,) = sides(model, preset(n=10))
    steps = []
    run(server, RunControl(), steps.append)
    assert server.done and steps[-1].completed == 10 and not steps[-1].running and not steps[-1].waiting
    engine = server.engine
    assert steps[-1].generated == sum(len(r.generated) for r in engine.requests.values())
    assert sum(s.prefill_tokens + s.decode_tokens for s in steps) == sum(
        s.n_tokens for step in steps if step.record for s in step.record.seqs)
    assert steps[-1].prefix_hits == engine.cache.prefix_stats.hits > 0
    assert len([t for s in steps for t in s.ttft]) == 10
    rows = server.request_rows()
    assert [r.id for r in rows] == list(range(10)) and all(r.phase == "done" for r in rows)
    for row in rows:
        request = engine.requests[server.tracks[row.id].seq_id]
        assert row.n_generated == len(request.generated) and row.stop_reason == request.stop_reason
        assert [p for p, _, _ in row.segments][0] == "queued" and row.segments[-1][0] == "done"
        assert all(b[1] == a[2] for a, b in zip(row.segments, row.segments[1:]))  # one unbroken life
        first = next(step.t1 for step in steps if step.record is not None and any(
            s.seq_id == request.seq_id and s.next_token >= 0 for s in step.record.seqs))
        assert row.ttft == pytest.approx(first - row.arrival)


def test_a_and_b_see_the_same_arrivals_and_prefix_caching_feeds_fewer_prompt_tokens(model):
    p = preset(compare="prefix", n=10)
    schedule, (a, b) = sides(model, p)
    pair = ServerPair(a, b)
    seen = {"A": [], "B": []}

    def on_step(step):
        other = b if step.side == "A" else a
        assert step.t0 <= other.clock or other.done  # lockstep in server time: the side behind steps
        for rid in step.arrived:
            side = a if step.side == "A" else b
            arrival = side.tracks[rid].arrival
            seen[step.side].append((rid, arrival.time, arrival.prompt_ids))

    run(pair, RunControl(), on_step)
    assert seen["A"] == seen["B"] and len(seen["A"]) == 10
    assert [x[2] for x in seen["A"]] == [schedule.get(i).prompt_ids for i in range(10)]
    assert a.engine.cache.prefix_stats.hits > 0 and b.engine.cache.prefix_stats.queries == 0
    a_generated = [len(r.generated) for r in sorted(a.engine.requests.values(), key=lambda r: r.seq_id)]
    b_generated = [len(r.generated) for r in sorted(b.engine.requests.values(), key=lambda r: r.seq_id)]
    assert a_generated == b_generated  # the same requests decode the same lengths on both sides


@pytest.mark.slow
def test_contiguous_reservation_admits_only_what_its_reservations_fit(model):
    p = preset(compare="contiguous", pool_pages=80, max_seqs=8, n=10, rate=6000, max_new_tokens=80)
    _, (paged, contiguous) = sides(model, p)
    assert contiguous.config.reservation == "contiguous" and not contiguous.config.prefix_caching
    peak = {"A": 0, "B": 0}

    def on_step(step):
        peak[step.side] = max(peak[step.side], len(step.running))
        if step.side == "B":
            assert step.reserved_pages <= step.pool_pages

    run(ServerPair(paged, contiguous), RunControl(), on_step)
    assert peak["B"] < peak["A"]  # reserving the maximum up front admits fewer at once
    with pytest.raises(ConfigError):
        ServerConfig(reservation="contiguous", prefix_caching=True)


def test_a_small_pool_preempts_and_the_preempted_recompute(model):
    _, (server,) = sides(model, preset(kind="documents", pool_pages=48, max_seqs=4, n=6, rate=6000, document_words=20,
                                       max_new_tokens=60))
    steps = []
    run(server, RunControl(), steps.append)
    assert any(s.preempted_now for s in steps) and steps[-1].preemptions == server.engine.preemptions > 0
    preempted = {rid for s in steps for rid in s.preempted}
    rows = {r.id: r for r in server.request_rows()}
    assert preempted and all("preempted" in [p for p, _, _ in rows[r].segments] for r in preempted)
    assert all(r.phase == "done" for r in rows.values())


def test_the_kv_curve_is_the_fullest_layers_pool_on_a_hybrid_model():
    """With sliding-window layers beside a global one, each layer's pool holds different pages: the KV curve is the
    fullest pool's (counted from the block tables, brute force), not layer 0's (a local one here)."""
    hybrid = replace(SYNTH, sliding_window=8, global_every=2).load()  # layer 0 local (8 positions), layer 1 global
    _, (server,) = sides(hybrid, preset(n=3, max_new_tokens=4))
    cache, apart = server.engine.cache, False
    for _ in range(12):
        step = server.step()
        pages = [len({p for s in cache.seq_ids() for p in cache.block_table(s, layer)}) for layer in range(2)]
        assert step.pages_used == max(pages)
        apart |= pages[0] < pages[1]
    assert apart


def test_the_forest_is_the_pools_prefix_cache_with_parents_by_the_engines_own_hash(model):
    from pagevis.simserver.forest import REMOVED
    from pagevis.kvcache.prefix_cache import ROOT_HASH, page_hash

    _, (server,) = sides(model, preset(n=6))
    hits = []
    run(server, RunControl(), lambda step: hits.extend(
        e for e in (step.record.events if step.record else ()) if e.kind is EventKind.PREFIX_HIT))
    pool = server.engine.cache.stores[0].pages
    nodes = [n for n in server.forest.nodes(server.engine) if not n.flags & REMOVED]
    assert {n.key for n in nodes} == set(pool.hash_frame) and nodes
    for node in nodes:
        parent, tokens, _ = server.forest._info[node.key]
        assert page_hash(parent, tokens) == node.key  # the parent link is the one the engine hashed with
        assert node.parent == (parent if parent in pool.hash_frame else None) and node.n_tokens == 8
        assert node.state == "cached" and node.refs == 0  # every request is done: all free, still cached
    root = next(n for n in nodes if server.forest._info[n.key][0] == ROOT_HASH)
    assert root.hits == len(hits) > 0  # every prefix hit of the shared system prompt reused its first page
    assert sum(n.hits for n in nodes) == sum(e.detail // 8 for e in hits)  # nothing was reclaimed: all still here


def test_presets_are_valid_and_found_by_name():
    for p in SERVER_PRESETS:
        assert side_configs(p.server, p.compare) and p.session_config().policy == "none"
    assert find_server_preset(None) is SERVER_PRESETS[0]
    assert find_server_preset("long documents").workload.kind == "documents"
    with pytest.raises(ConfigError):
        find_server_preset("no such")


# --- the window ----------------------------------------------------------------------------------------------

pytest.importorskip("pytestqt")


def window(qtbot, model, p: ServerPreset):
    from pagevis.gui.server.window import ServerWindow

    w = ServerWindow(model, p, realtime=False)
    qtbot.addWidget(w)
    w.resize(1500, 950)
    w.show()
    return w


def check_views_against_the_engine(w) -> None:
    """Every view of every side against the engine's live state after the step just taken."""
    from pagevis.simserver.forest import REMOVED
    from pagevis.gui.server.pool import pool_cells

    for server in w.sides:
        if server.side not in w.latest:  # an A/B side that has not stepped yet
            continue
        panel, engine, step = w.panels[server.side], server.engine, w.latest[server.side]
        assert step is server.last_step
        rid = server.request_id
        # the pool: every page's ref count and owners as the engine's pool and block tables hold them
        pool = engine.cache.stores[0].pages
        if step.record is not None:
            assert step.pool is step.record  # (an idle step shows the newest engine record: nothing changed)
        if step.pool is not None:
            cells = panel.pool.cells
            assert cells == pool_cells(step)
            assert [c.ref_count for c in cells] == pool.ref_counts.tolist()
            owners = {}
            for seq_id in engine.cache.seq_ids():
                for page in engine.cache.block_table(seq_id, 0):
                    owners.setdefault(page, []).append(rid(seq_id))
            assert {c.page: list(c.owners) for c in cells if c.owners} == owners
            assert {c.page for c in cells if c.state == "cached"} == set(pool.cached_free())
        # the queues: the scheduler's own, in order (and requests held back by a contiguous reservation)
        ids = panel.queues.ids
        assert ids["running"] == tuple(rid(s) for s in engine.running)
        preempted = tuple(rid(s) for s in engine.waiting if engine.requests[s].preemptions)
        assert ids["preempted"] == preempted
        assert ids["waiting"] == tuple(r for r in [*server.held, *map(rid, engine.waiting)] if r not in preempted)
        # the plots: the newest point of each curve is the engine's number after this step
        drawn = w.plots.drawn[server.side]
        assert drawn["kv"][1][-1] == pytest.approx(100 * engine.cache.pages_used() / server.config.pool_pages)
        assert drawn["reserved"][1][-1] == pytest.approx(100 * server.reserved_pages() / server.config.pool_pages)
        stats = engine.cache.prefix_stats
        if stats.queries:
            assert drawn["hits"][1][-1] == pytest.approx(100 * stats.hits / stats.queries)
        series = w.series[server.side]
        assert series["generated"][-1] == sum(len(r.generated) for r in engine.requests.values())
        assert len(drawn["ttft"][1]) == sum(1 for t in server.tracks.values() if t.times.first_token is not None)
        if step.record is not None:
            bars = panel.batch
            assert bars.prefill_tokens[-1] == sum(s.n_tokens for s in step.record.seqs if s.kind == "prefill")
            assert bars.decode_tokens[-1] == sum(s.n_tokens for s in step.record.seqs if s.kind == "decode")
        # the timeline: each request's phase is where the engine has it now
        for row in panel.timeline.rows:
            track = server.tracks[row.id]
            request = engine.requests.get(track.seq_id)
            if request is None:
                assert row.phase in ("queued", "done")
            elif request.done:
                assert row.phase == "done" and row.stop_reason == request.stop_reason
            elif track.seq_id in engine.running:
                assert row.phase in ("prefill", "decode")
                assert row.n_generated == len(request.generated)
            else:
                assert row.phase == ("preempted" if request.preemptions else "queued")
        # the forest: exactly the pool's cached pages, with their ref counts
        nodes = [n for n in panel.forest.nodes if not n.flags & REMOVED]
        assert {n.key for n in nodes} == set(pool.hash_frame)
        assert all(n.refs == pool.ref_counts[pool.hash_frame[n.key]] for n in nodes)
        assert panel.forest.block_count == len(nodes)


def test_the_window_runs_a_seeded_workload_and_every_view_agrees_with_the_engine_at_every_step(qtbot, model):
    w = window(qtbot, model, preset(n=8))
    for _ in range(60):
        if w.stepper.done:
            break
        assert w.step_blocking(1) == 1
        check_views_against_the_engine(w)
    assert w.series["A"]["completed"][-1] >= 1
    hits = [n.hits for n in w.panels["A"].forest.nodes]
    assert max(hits) >= 1  # the shared system prompt's pages were reused, and the forest names them
    assert "You answer questions" in w.panels["A"].forest.hot.text()
    assert "tok/s" in w.summary.text()


def test_the_ab_window_steps_both_sides_on_the_same_arrivals(qtbot, model):
    w = window(qtbot, model, preset(compare="prefix", n=6))
    assert set(w.panels) == {"A", "B"}
    while not w.stepper.done:
        w.step_blocking(1)
        check_views_against_the_engine(w)
    a, b = w.sides
    assert [t.arrival for t in a.tracks.values()] == [t.arrival for t in b.tracks.values()]
    assert w.series["A"]["completed"][-1] == w.series["B"]["completed"][-1] == 6
    prefill = {s: int(w.series[s]["prefill"].sum()) for s in "AB"}
    assert prefill["A"] < prefill["B"]  # the shared prompt computed once on A
    assert "A/B" in w.summary.text()


@pytest.mark.slow
def test_preemption_shows_in_the_queues_and_timeline_when_the_pool_is_small(qtbot, model):
    w = window(qtbot, model, preset(kind="documents", pool_pages=48, max_seqs=4, n=6, rate=6000, document_words=20,
                                    max_new_tokens=60))
    shown = set()
    while not w.stepper.done:
        w.step_blocking(1)
        check_views_against_the_engine(w)
        shown |= set(w.panels["A"].queues.ids["preempted"])
    assert shown and w.sides[0].engine.preemptions > 0
    rows = {r.id: r for r in w.panels["A"].timeline.rows}
    assert any("preempted" in [p for p, _, _ in rows[r].segments] for r in shown if r in rows)
    assert w.panels["A"].timeline.bars._rects["preempted"]


def test_run_in_the_worker_thread_redraws_at_most_30_times_a_second_and_pauses(qtbot, model):
    import time

    w = window(qtbot, model, preset(n=200, rate=600))
    w.max_running.setValue(2)
    assert w.sides[0].engine.scheduler.max_running == 2  # a live control
    frames = w.frames
    started = time.perf_counter()
    w.run_button.setChecked(True)
    qtbot.waitUntil(lambda: len(w.series["A"]) >= 40, timeout=30000)
    w.run_button.setChecked(False)
    qtbot.waitUntil(lambda: not w.busy and not w.drawing, timeout=30000)
    elapsed = time.perf_counter() - started
    assert w.frames - frames <= 30 * elapsed + 2
    taken = len(w.series["A"])
    qtbot.wait(100)
    assert len(w.series["A"]) == taken  # paused: nothing steps
    check_views_against_the_engine(w)
    w.rate.setValue(1200)
    assert w.schedule.rate_per_min == 1200
    w.close()


def test_view_server_opens_on_the_main_windows_model_and_runs(qtbot, tmp_path):
    from gui_helpers import make_window

    main = make_window(qtbot, tmp_path)
    view = next(a.menu() for a in main.menuBar().actions() if a.text() == "&View")
    assert any(a.text().replace("&", "").startswith("Server") for a in view.actions())
    server = main.open_server(replace(preset(n=4), server=replace(preset().server, step_seconds=None)))
    qtbot.addWidget(server)
    assert server.model is main.runner.model
    qtbot.waitUntil(lambda: len(server.series["A"]) > 0, timeout=30000)  # it runs at once: one click
    server.close()
    assert not server.busy and not server.sides


def test_server_demo_screenshot_from_the_command_line(qtbot, tmp_path):
    from pagevis.cli.main import main

    path = tmp_path / "server.png"
    assert main(["--server-demo", "returning", "--model", "synthetic", "--layers", "2", "--heads", "4",
                 "--screenshot", str(path), "--steps", "30"]) == 0
    assert path.stat().st_size > 10_000
    assert main(["--server-demo", "no such preset", "--screenshot", str(tmp_path / "x.png")]) == 2


# --- attached to a running `pagevis serve` --------------------------------------------------------------------

def test_metrics_series_from_pagevis_serve_metrics_text():
    from pagevis.viewmodel.server_series import MetricsSeries, parse_serve_metrics
    from pagevis.observe import Metrics
    from prometheus_client import generate_latest

    metrics = Metrics()
    series = MetricsSeries()
    for t, (tokens, ttfts, itls) in enumerate(((0, (), ()), (5, (0.5, 1.5), (0.1,) * 3), (12, (), (0.2,) * 7))):
        metrics.generation_tokens.inc(tokens)
        for value in ttfts:
            metrics.time_to_first_token.observe(value)
        for value in itls:
            metrics.inter_token_latency.observe(value)
        metrics.prefix_cache_queries.inc(100)
        metrics.prefix_cache_hits.inc(50 * t)
        series.add(parse_serve_metrics(generate_latest(metrics.registry).decode(), when=10.0 + 2 * t))
    assert series["t"].tolist() == [0, 2, 4] and series["generated"].tolist() == [0, 5, 17]
    assert series.throughput()[1].tolist() == pytest.approx([0, 2.5, 4.25])
    assert series.ttft_t.values.tolist() == [2] and series.ttft.values.tolist() == pytest.approx([1.0])
    assert series["itl"][1:].tolist() == pytest.approx([0.1, 0.2])
    assert series.hit_rate().tolist()[1:] == pytest.approx([50.0, 75.0])  # (50 + 100) / 200 since the first scrape


@pytest.mark.slow
def test_the_window_attached_to_pagevis_serve_shows_its_cache_and_metrics(qtbot):
    from serve_fixtures import running_server

    from pagevis.gui.server.attached import AttachedServerWindow
    from pagevis.viewmodel.server_series import parse_serve_metrics

    with running_server(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*",
                        pool_pages=64) as running:
        system = "You answer questions about pages of keys and values. " * 3
        for i in range(3):  # a shared prefix: the forest's first pages are one branch for all three
            answer = running.client.post("/v1/completions", json={
                "model": "synthetic", "prompt": f"{system}Question {i}?", "max_tokens": 4, "temperature": 0,
                "pagevis": {"page_size": 4, "max_pages": 64}})
            assert answer.status_code == 200, answer.text
        publisher = running.app.state.engines.kv_events.publisher
        core = next(iter(running.app.state.engines.cores.values()))
        cached = core.call(lambda: set(core.engine.cache.stores[0].pages.hash_frame)).result(30)
        window = AttachedServerWindow(f"{publisher.endpoint},{publisher.replay_endpoint}",
                                      f"{running.url}/metrics", detokenizer=lambda ids: bytes(ids).decode())
        qtbot.addWidget(window)
        window.show()

        def forest_keys():
            rows = window.forest.rows
            return {rows.key(i)[-1] for i in range(len(rows)) if not rows.flags[i] & 2}

        qtbot.waitUntil(lambda: len(window.series) >= 2 and forest_keys() == cached, timeout=30000)
        assert len(cached) > 10
        served = parse_serve_metrics(running.metrics_text())
        assert window.series.samples[-1].generated == served.generated == 12  # three answers of 4 tokens
        assert window.series.samples[-1].queries == served.queries > 0
        assert "they need the engine itself" in window.header.text()
        window.close()
    assert not window.fleet_worker.isRunning() and not window.metrics_worker.isRunning()


def test_the_ab_column_compares_only_numbers_both_sides_have_and_says_which_way_is_better(qtbot, model, monkeypatch):
    import re

    from clipping import plain

    from pagevis.gui.server import window as server_window

    monkeypatch.setattr(server_window, "MIN_SERVED", 2)  # of the preset's 6 requests
    w = window(qtbot, model, preset(compare="prefix", n=6))

    def rows() -> dict[str, list[str]]:
        lines = plain(w.summary.text()).replace("\u00a0", " ").split("\n")
        return {line.split("  ")[0].strip(): line for line in lines}

    w.redraw()
    assert "×" not in w.summary.text()  # nothing served yet
    def served(n: int) -> bool:
        return all(s.summary() and s.summary()["completed"] >= n for s in w.series.values())

    while not served(2):
        w.step_blocking(1)
        w.redraw()
        if not served(2):  # no ratio until both sides have served 2 requests (throughput read 15.96× at 16 s,
            assert "×" not in w.summary.text()  # ~2× steady; and 2.01× at 0 tokens)
            assert "once both have served 2 requests" in plain(w.summary.text())
    w.redraw()
    a, b = (w.series[s].summary() for s in "AB")
    html = w.summary.text()
    for label, key, way in (("throughput", "throughput", "higher"), ("mean TTFT", "ttft_mean", "lower"),
                            ("tokens generated", "generated", "higher"), ("peak KV pages", "peak_pages", "lower")):
        row = re.search(rf"<tr><td>{label}</td>(.*?)</tr>", html).group(1)
        if a[key] and b[key] and a[key] == a[key] and b[key] == b[key]:
            assert f"{a[key] / b[key]:.2f}×" in row and f"{way} is better" in row
            better = (a[key] > b[key]) == (way == "higher")
            assert ("#7ee787" in row) == (better and a[key] != b[key])
        else:
            assert "×" not in row
    server_time = re.search(r"<tr><td>server time</td>(.*?)</tr>", html).group(1)
    assert "×" not in server_time  # the clock is not a result

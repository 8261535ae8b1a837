"""`pagevis bench serve`'s workload and accounts: each level's users are its own, the engine's steps per level come
from two scrapes of /metrics, and the engine alone runs the same kind of requests (serving_bare)."""

from __future__ import annotations

import pytest
from serve_fixtures import SYNTH

from pagevis.bench.serving import engine_steps
from pagevis.bench.serving_workload import Users, first_turn
from pagevis.bench.serving_bare import BareClients, bare_over


def test_every_level_has_users_of_its_own_and_a_round_repeats_its_own():
    one, eight = Users(0, "1.1"), Users(0, "1.2")
    firsts = [one.next()[1] for _ in range(8)]
    assert not set(firsts) & {eight.next()[1] for _ in range(8)}  # the same seed, other readers
    assert [Users(0, "1.1").next()[1] for _ in range(1)] == firsts[:1]
    assert all(question.startswith("I am reader 1.1-") for question in firsts)


def test_engine_steps_are_the_difference_of_two_scrapes():
    before = {"pagevis_engine_step_seconds_count/decode": 10, "pagevis_engine_step_seconds_sum/decode": 0.5,
              "pagevis_iteration_tokens_sum/decode": 40, "pagevis_request_queue_time_seconds_count/": 2,
              "pagevis_request_queue_time_seconds_sum/": 0.1}
    after = {"pagevis_engine_step_seconds_count/decode": 14, "pagevis_engine_step_seconds_sum/decode": 0.9,
             "pagevis_iteration_tokens_sum/decode": 72, "pagevis_engine_step_seconds_count/mixed": 1,
             "pagevis_engine_step_seconds_sum/mixed": 0.3, "pagevis_iteration_tokens_sum/mixed": 30,
             "pagevis_request_queue_time_seconds_count/": 4, "pagevis_request_queue_time_seconds_sum/": 0.5}
    steps = engine_steps(before, after, seconds=1.0)
    assert steps["steps"] == {"decode": 4, "prefill": 0, "mixed": 1}
    assert steps["decode_rows_per_step"] == 8.0
    assert steps["busy_share"] == pytest.approx(0.7)
    assert steps["queue_ms"] == pytest.approx(200.0)


def test_the_engine_alone_runs_one_and_eight_clients_requests():
    """Two users one request at a time, eight in lockstep, each a first turn then the returning turn carrying the
    answer it got; nothing but the system prompts is cached, so both levels feed alike prompt rows per token."""
    model = SYNTH.load()
    clients = BareClients(model, max_tokens=4)
    one, eight = clients.level(1, "t1"), clients.level(8, "t8")
    assert one["output_tokens"] == 2 * 2 * 4 and eight["output_tokens"] == 8 * 2 * 4
    assert not clients.engine.requests and not clients.answers  # every request forgotten, every answer used
    system = len(model.tokenizer.encode_chat(first_turn(0, "x")))
    assert 1 < one["prompt_rows_per_output_token"] < system / 4  # the system prompts came from the cache
    assert eight["prompt_rows_per_output_token"] == pytest.approx(one["prompt_rows_per_output_token"], rel=0.5)
    ratio = bare_over([one, eight], {"c8_over_c1": 3.0})
    assert ratio["bare_c8_over_c1"] == eight["output_throughput"] / one["output_throughput"]
    assert ratio["served_over_bare"] == pytest.approx(3.0 / ratio["bare_c8_over_c1"])


def test_the_engine_alone_takes_the_servers_dtype():
    """`bench serve --dtype` gives the engine alone the server's K/V storage; without it, serve's default."""
    from pagevis.bench.serving_bare import bare_engine
    from pagevis.serve.settings import serve_defaults

    model = SYNTH.load()
    assert bare_engine(model).cache.config.dtype == serve_defaults().dtype == "float32"
    assert bare_engine(model, dtype="float16").cache.config.dtype == "float16"

"""`pagevis bench startup`: the app's phases from spawn to its first drawn frame, from a real start (the probe
in the app), and the table that says where the time goes."""

from __future__ import annotations

import json

import pytest

from pagevis.bench.gui.startup import cached_bytes, evict_from_page_cache, format_rows, spans
from pagevis.cli.main import main
from pagevis.gui.startup import PHASES

ROW = {"run": "warm", "phases": dict(zip(PHASES, (0.4, 0.7, 1.3, 1.5, 3.9, 4.0))),
       "cpu": dict(zip(PHASES, (0.3, 0.6, 1.1, 1.2, 3.5, 3.5)))}


def test_spans_are_each_phases_own_time_and_the_table_says_the_target():
    assert [(p, round(w, 2), round(c, 2)) for p, w, c in spans(ROW)] == [
        ("launch", 0.4, 0.3), ("qt", 0.3, 0.3), ("window", 0.6, 0.5), ("first_paint", 0.2, 0.1), ("ready", 2.4, 2.3),
        ("ready_drawn", 0.1, 0.0)]
    table = format_rows([{**ROW, "run": "cold"}, ROW], "smollm2")
    assert "first drawn frame, warm: 1.50 s (meets the 3 s target) after 1.20 s of CPU" in table
    assert "ready 2.40 / 2.30" in table and table.count("\n  CPU") == 2


def test_evicting_from_the_page_cache_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10000)
    assert evict_from_page_cache([path, tmp_path / "missing"]) == 10000
    assert path.read_bytes() == b"x" * 10000
    assert 0 < cached_bytes([path]) <= 12288  # just read: its 3 pages (or fewer) are cached
    assert cached_bytes([tmp_path / "missing"]) == 0


def test_bench_startup_bad_arguments(capsys):
    assert main(["bench", "startup", "--starts", "0"]) == 2
    assert "--starts 0: must be from 1 to 20" in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_start_reports_every_phase_in_order(capsys):
    assert main(["bench", "startup", "--model", "synthetic", "--starts", "1", "--no-cold", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    wall, cpu = row["phases"], row["cpu"]
    assert row["run"] == "warm" and set(wall) == set(cpu) == set(PHASES)
    for clock in (wall, cpu):  # the start's order; the small model may be ready before the first paint
        assert 0 < clock["launch"] <= clock["qt"] <= clock["window"] <= min(clock["first_paint"], clock["ready"])
        assert max(clock["first_paint"], clock["ready"]) <= clock["ready_drawn"]
    assert cpu["ready_drawn"] < 2 * wall["ready_drawn"] + 1  # CPU seconds of all threads, on 2 cores

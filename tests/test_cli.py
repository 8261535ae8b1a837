"""The command line: run --json, bad arguments (status 2, one line, no traceback), replay --check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagevis.__main__ import main

SYNTH = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def run_main(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_run_json_has_the_keys(capsys):
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "hello paging", "--page-size", "4",
                                "--max-pages", "3", "--max-tokens", "20", "--oracle", "--json", "--quiet")
    assert status == 0, err
    summary = json.loads(out)
    for key in ("model", "prompt_tokens", "generated_tokens", "text", "page_size", "max_pages", "policy",
                "evictions", "peak_resident_tokens", "tokens_per_s", "mean_kl", "top1_agreement"):
        assert key in summary, key
    assert summary["generated_tokens"] == 20 and summary["prompt_tokens"] > 0
    assert summary["peak_resident_tokens"] == 12 and summary["evictions"] > 0
    assert summary["page_size"] == 4 and summary["policy"] == "sinks"
    assert 0 <= summary["top1_agreement"] <= 1 and summary["mean_kl"] >= 0


def test_run_json_rates_are_the_wall_clock_with_the_oracle_inside(capsys):
    """One clock: the prompt's time to the first token and the decoded tokens' time after it add up to the run's
    seconds, the oracle's full-cache forwards included (they were left out of tokens_per_s before)."""
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "hello paging", "--page-size", "4",
                                "--max-pages", "3", "--max-tokens", "30", "--oracle", "--json", "--quiet")
    assert status == 0, err
    summary = json.loads(out)
    waited = (summary["prompt_tokens"] / summary["prefill_tokens_per_s"]
              + (summary["generated_tokens"] - 1) / summary["tokens_per_s"])
    assert 0.9 * summary["seconds"] <= waited <= summary["seconds"]


def test_run_json_reports_the_disk_tier(capsys, tmp_path):
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "hello paging", "--page-size", "4",
                                "--max-pages", "3", "--disk-pages", "8", "--select", "quest", "--select-pages", "2",
                                "--swap-dir", str(tmp_path), "--max-tokens", "20", "--oracle", "--json", "--quiet")
    assert status == 0, err
    summary = json.loads(out)
    tiers = summary["tiers"]
    assert summary["capacity"] == 32 and summary["disk_pages"] == 8 and summary["select"] == "quest"
    assert tiers["faults"] > 0 and tiers["swapped_out"] > 0 and 0 < tiers["hit_rate"] < 1
    assert tiers["bytes_read"] == tiers["faults"] * tiers["page_bytes"]
    assert len(tiers["per_step"]) == summary["steps"] and len(tiers["per_step"][-1]["faults"]) == 2
    assert 0 < tiers["mean_recall"] < 1
    assert os.listdir(tmp_path) == []  # the swap folder went with the run


def test_run_prints_text_and_writes_a_trace(capsys, tmp_path):
    trace = tmp_path / "run.pvtrace"
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "hi", "--max-tokens", "5", "--no-chat",
                                "--policy", "oldest", "--trace", str(trace), "--record-layers", "0")
    assert status == 0, err
    assert out.endswith("\n") and trace.exists()
    status, out, err = run_main(capsys, "replay", str(trace), "--check")
    assert status == 0 and "policy oldest" in out and "stopped: max_new_tokens" in out


def test_policy_none_refuses_a_prompt_longer_than_the_cache(capsys):
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "a longer prompt than fits", "--no-chat",
                                "--policy", "none", "--page-size", "4", "--max-pages", "2", "--json")
    assert status == 2 and out == ""
    assert "--policy none: the prompt is 25 tokens but the cache holds 8" in err and len(err.splitlines()) == 1


def test_policy_none_stops_when_decoding_fills_the_cache(capsys):
    status, out, err = run_main(capsys, "run", *SYNTH, "--prompt", "ab", "--no-chat", "--policy", "none",
                                "--page-size", "4", "--max-pages", "1", "--max-tokens", "10", "--json")
    assert status == 0
    assert json.loads(out)["stop_reason"] == "cache_full" and "full" in err


@pytest.mark.parametrize("argv, message", [
    (["run", "--page-size", "0"], "--page-size: page_size = 0 is not allowed"),
    (["run", "--page-size", "x"], "argument --page-size: invalid int value: 'x'"),
    (["run", "--policy", "lifo"], "argument --policy: invalid choice: 'lifo'"),
    (["run", "--policy", "sinks", "--policy-param", "n_sink=999", "--max-pages", "2"], "--policy-param: sinks.n_sink"),
    (["run", "--policy-param", "bogus"], "expected KEY=VALUE"),
    (["run", "--model", "/nonexistent/model.gguf"], "no such file"),
    (["run", "--layers", "2"], "only apply to --model synthetic"),
    (["run", "--prompt-file", "/nonexistent.txt"], "--prompt-file /nonexistent.txt: no such file"),
    (["run", "--temperature", "0"], "--temperature: sampling.temperature = 0.0 is not allowed"),
    (["run", "--record-layers", "a,b"], "--record-layers"),
    (["replay", "/nonexistent.pvtrace"], "no such trace file"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["--page-size", "-3"], "--page-size: page_size = -3"),
    (["run", "--disk-pages", "-1"], "--disk-pages: disk_pages = -1 is not allowed"),
    (["run", "--disk-pages", "8", "--max-pages", "1"], "--max-pages: max_pages = 1 is not allowed: at least 2 with a disk tier"),
    (["run", "--select", "best"], "argument --select: invalid choice: 'best'"),
    (["run", "--select", "quest", "--select-pages", "0"], "--select-pages: select_pages = 0 is not allowed"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    if argv[0] == "run" and "--model" not in argv and "--layers" not in argv:
        argv = argv + SYNTH
    status, out, err = run_main(capsys, *argv)
    assert status == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_app_refuses_a_file_that_is_not_gguf_before_opening_a_window(capsys, tmp_path):
    notes = tmp_path / "notes.gguf"
    notes.write_text("shopping list")
    status, out, err = run_main(capsys, "--model", str(notes))
    assert status == 2 and err.count("\n") == 1
    assert f"--model: {notes} is not a GGUF file (it starts with b'shop'" in err


@pytest.mark.slow
def test_a_screenshot_of_a_model_that_cannot_load_says_why(tmp_path):
    """A file whose structure is sound (a truncated one is refused before the window opens) but whose model
    cannot be built: the window's load fails and says why."""
    broken = tmp_path / "no-tokenizer.gguf"
    broken.write_bytes((Path(__file__).parent / "data" / "hostile" / "gguf-no-tokenizer.gguf").read_bytes())
    done = subprocess.run([sys.executable, "-m", "pagevis", "--model", str(broken), "--screenshot",
                           str(tmp_path / "shot.png"), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert done.returncode == 1 and not (tmp_path / "shot.png").exists()
    assert f"pagevis: Could not load the model: {broken}: metadata key tokenizer.ggml.model is missing" in done.stderr
    assert done.stderr.count(str(broken)) == 1  # the path once (it was twice)


def test_the_app_refuses_a_truncated_file_before_opening_a_window(capsys, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes((Path(__file__).parent / "data" / "tiny-qwen2.gguf").read_bytes()[:100])
    status, out, err = run_main(capsys, "--model", str(truncated))
    assert status == 2 and err.count("\n") == 1
    assert f"--model: {truncated} (100 bytes) is truncated or corrupt" in err


def test_bad_trace_file_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.pvtrace"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    status, out, err = run_main(capsys, "replay", str(bad), "--check")
    assert status == 2 and "not a pagevis trace" in err


def test_help_exits_0(capsys):
    assert main(["run", "--help"]) == 0
    assert "--policy-param" in capsys.readouterr().out


def test_python_m_pagevis_bad_argument_in_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "pagevis", "run", "--max-pages", "0", *SYNTH],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("pagevis run: error: --max-pages: max_pages = 0 is not allowed: an integer from 1")
    assert done.stderr.count("\n") == 1


def test_headless_commands_never_import_qt(tmp_path):
    code = ("import sys; from pagevis.__main__ import main; "
            f"assert main(['run', *{SYNTH!r}, '--max-tokens', '3', '--json', '--trace', {str(tmp_path / 't')!r}]) == 0; "
            f"assert main(['replay', {str(tmp_path / 't')!r}, '--check']) == 0; "
            "assert main(['compare', '--model', 'synthetic', '--tokens', '40', '--budgets', '16', '--no-files']) == 0; "
            "assert not [m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph'))], 'Qt was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_app_options_reach_launch(monkeypatch, tmp_path):
    import pagevis.gui

    calls = []
    monkeypatch.setattr(pagevis.gui, "launch", lambda **kwargs: calls.append(kwargs) or 0)
    assert main([]) == 0
    assert calls[-1] == dict(model_spec=None, prompt=None, session_config=None, screenshot=None, steps=0, metrics=None,
                             preset=None, recording=None)
    assert main([*SYNTH, "--prompt", "hi", "--page-size", "8", "--policy", "tova", "--screenshot", "s.png",
                 "--steps", "3"]) == 0
    call = calls[-1]
    assert call["model_spec"].kind == "synthetic" and call["model_spec"].n_layers == 2
    assert call["prompt"] == "hi" and call["screenshot"] == "s.png" and call["steps"] == 3
    assert call["session_config"].page_size == 8 and call["session_config"].policy == "tova"
    assert main(["--present"]) == 0 and calls[-1]["present"] is True  # the presentation layout
    assert main(["--no-present"]) == 0 and calls[-1]["present"] is False
    assert main(["--preset", "streaming"]) == 0  # a preset sets prompt and cache; an A/B one opens both
    call = calls[-1]
    assert call["preset"].name == "StreamingLLM: window vs sinks" and call["session_config"] == call["preset"].a
    assert call["prompt"] == call["preset"].prompt_text()
    trace = tmp_path / "t.pvtrace"
    assert main(["run", *SYNTH, "--max-tokens", "2", "--trace", str(trace), "--quiet"]) == 0
    assert main(["replay", str(trace)]) == 0
    assert calls[-1] == dict(trace=str(trace), recording=None)


@pytest.mark.slow
def test_screenshot_from_the_command_line(tmp_path):
    shot = tmp_path / "shot.png"
    done = subprocess.run([sys.executable, "-m", "pagevis", *SYNTH, "--prompt", "hello", "--no-chat",
                           "--page-size", "4", "--max-pages", "4", "--screenshot", str(shot), "--steps", "3"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert done.returncode == 0, done.stderr
    assert shot.read_bytes()[:4] == b"\x89PNG"

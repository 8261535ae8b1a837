"""Hostile and careless command lines: every numeric flag is bounded (by memory where that is the real limit),
empty or invalid prompts and unwritable outputs are refused before any work, errors name only flags the command
has, and an unexpected exception is one line with status 70 (the traceback only with --debug)."""

from __future__ import annotations

import pytest

from pagevis.__main__ import main
from pagevis.cli import main as cli_main

SYNTH = ["--model", "synthetic", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]


def refusal(capsys, *argv) -> str:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == 2, err
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("argv, message", [
    (["run", "--model", "synthetic", "--head-dim", "1000000"], "--head-dim 1000000: must be from 1 to 1024"),
    (["run", "--model", "synthetic", "--layers", "100000"], "--layers 100000: must be from 1 to 1024"),
    (["run", "--model", "synthetic", "--heads", "100000", "--kv-heads", "1"], "--heads 100000: must be from 1 to"),
    (["run", "--model", "synthetic", "--head-dim", "7"], "--head-dim: head_dim = 7 is not allowed: even"),
    (["run", "--model", "synthetic", "--layers", "1024", "--heads", "1024", "--kv-heads", "1", "--head-dim", "64"],
     "the synthetic model's weights would take"),
    (["run", "--model", "synthetic", "--heads", "1024", "--kv-heads", "1024", "--head-dim", "1024"],
     "--heads x --head-dim: d_model = 1048576"),
    (["run", "--model", "synthetic", "--model-seed", "99999999999999"], "--model-seed 99999999999999: must be from 0"),
    (["run", *SYNTH, "--blas-threads", "1000000"], "--blas-threads 1000000: must be from 1 to"),
    (["run", *SYNTH, "--max-tokens", str(10**12)], "--max-tokens: max_new_tokens = 1000000000000"),
    (["bench", "--decode-tokens", str(10**12), "--no-files", "--quick"], "--decode-tokens 1000000000000: must be from 1"),
    (["bench", "--contexts", str(1 << 40), "--no-files", "--quick", "--no-model"], "--contexts '1099511627776': each"),
    (["compare", "--tokens", str(10**9), *SYNTH, "--no-files"], "--tokens 1000000000: must be from 2"),
    (["compare", "--page-size", "100000", *SYNTH, "--no-files"], "--page-size 100000: must be from 1 to 4096"),
    (["--steps", "99999999999", "--screenshot", "s.png"], "--steps 99999999999: must be from 0"),
])
def test_numeric_flags_are_bounded(capsys, argv, message):
    assert message in refusal(capsys, *argv)


def test_errors_name_only_flags_the_command_has(capsys, tmp_path):
    wide = ["--model", "synthetic", "--layers", "1", "--heads", "4", "--kv-heads", "4", "--head-dim", "64"]
    err = refusal(capsys, "compare", "--budgets", "16777216", "--policies", "sinks", *wide, "--no-files", "--quiet")
    assert "--budgets: 16777216 tokens is too large" in err and "--max-pages" not in err
    err = refusal(capsys, "compare", "--budgets", str(1 << 40), *wide, "--no-files", "--quiet")
    assert "--budgets: 1099511627776 tokens is more than" in err
    err = refusal(capsys, "bench", "--decode-tokens", "0", "--no-files", "--quick")
    assert "--decode-tokens" in err and "--max-tokens" not in err
    # a policy parameter nobody gave is the policy's default, not a --policy-param the user typed
    err = refusal(capsys, "run", *SYNTH, "--prompt", "hi", "--max-pages", "1", "--page-size", "1", "--policy", "sinks")
    assert not err.startswith("pagevis run: error: --policy-param") and "the policy's default" in err
    err = refusal(capsys, "run", *SYNTH, "--max-pages", "1", "--page-size", "1", "--policy-param", "n_sink=4")
    assert err.startswith("pagevis run: error: --policy-param: sinks.n_sink = 4")


@pytest.mark.parametrize("argv, message", [
    (["run", *SYNTH, "--prompt", ""], "--prompt is empty"),
    (["run", *SYNTH, "--prompt", " \n "], "--prompt is empty"),
    (["run", *SYNTH, "--prompt-file", "/dev/null"], "--prompt-file /dev/null: the file is empty"),
    (["run", *SYNTH, "--prompt", "a\udcffb", "--no-chat"], "--prompt: not valid UTF-8 text (byte 0xff"),
    (["run", *SYNTH, "--prompt", "hi", "--special"], "--special only applies with --no-chat"),
    (["run", *SYNTH, "--prompt-file", "/dev/zero"], "--prompt-file /dev/zero: larger than 4 MiB"),
    (["compare", *SYNTH, "/dev/urandom", "--no-files"], "TEXTFILE /dev/urandom: larger than 4 MiB"),
    (["replay", "--check", "/dev/zero"], "/dev/zero: not a trace file"),
])
def test_prompts_that_are_empty_or_not_text_are_refused(capsys, argv, message):
    assert message in refusal(capsys, *argv)


def test_empty_huge_or_binary_prompt_files_are_refused(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "the file is empty" in refusal(capsys, "run", *SYNTH, "--prompt-file", str(empty))
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"a" * ((4 << 20) + 1))
    assert "larger than 4 MiB" in refusal(capsys, "run", *SYNTH, "--prompt-file", str(huge))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ab\xff")
    assert "not UTF-8 text (byte 0xff at offset 2)" in refusal(capsys, "run", *SYNTH, "--prompt-file", str(binary))


def test_a_tiny_temperature_samples_the_top_token(capsys):
    status = main(["run", *SYNTH, "--prompt", "hi", "--no-chat", "--temperature", "1e-300", "--max-tokens", "3",
                   "--quiet", "--json"])
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["run", *SYNTH, "--trace", "/proc/version"], "--trace /proc/version: cannot write in /proc"),
    (["run", *SYNTH, "--trace", "/nonexistent/x.pvtrace"], "no such folder /nonexistent"),
    (["run", *SYNTH, "--trace", "/dev/null"], "--trace /dev/null: not a regular file"),
    (["compare", *SYNTH, "--plot", "p.txt"], "--plot p.txt: the file is written as PNG"),
    (["compare", *SYNTH, "--csv", "/proc/x.csv"], "--csv /proc/x.csv: cannot write in /proc"),
    (["--screenshot", "/proc/s.png", *SYNTH], "--screenshot /proc/s.png: cannot write in /proc"),
    (["--screenshot", "shot.jpg", *SYNTH], "--screenshot shot.jpg: the file is written as PNG"),
])
def test_unwritable_outputs_are_refused_before_work(capsys, argv, message, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the output was checked")

    monkeypatch.setattr("pagevis.engine.model_spec.ModelSpec.load", no_model)
    assert message in refusal(capsys, *argv)


@pytest.mark.parametrize("argv, message", [
    (["replay", "--html", "", "tests/data/hostile/valid.pvtrace"], "--html: an empty path"),
    (["replay", "", "--check"], "FILE: an empty path"),
    (["run", *SYNTH, "--trace", ""], "--trace: an empty path"),
    (["compare", *SYNTH, "--csv", ""], "--csv: an empty path"),
    (["--screenshot", "", *SYNTH], "--screenshot: an empty path"),
])
def test_empty_paths_are_refused_not_taken_as_absent(capsys, argv, message, monkeypatch):
    """`--html ""` used to open the app (an empty name read as no flag at all)."""
    def no_app(*args, **kwargs):
        raise AssertionError("the app started")

    monkeypatch.setattr("pagevis.gui.launch", no_app)
    monkeypatch.setattr(cli_main, "launch_app", no_app)
    assert message in refusal(capsys, *argv)


def test_unexpected_error_is_one_line_with_status_70(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("something the code did not expect\nsecond line")

    monkeypatch.setattr(cli_main, "launch_app", broken)
    status = main(["--model", "synthetic"])
    err = capsys.readouterr().err
    assert status == 70 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "RuntimeError: something the code did not expect second line" in err and "--debug" in err
    status = main(["--model", "synthetic", "--debug"])
    err = capsys.readouterr().err
    assert status == 70 and "Traceback (most recent call last)" in err and "in broken" in err


def test_out_of_memory_is_a_user_error(capsys, monkeypatch):
    def exhausted(args):
        raise MemoryError("Unable to allocate 768. MiB")

    monkeypatch.setattr(cli_main, "launch_app", exhausted)
    assert main(["--model", "synthetic"]) == 2
    assert "out of memory (Unable to allocate 768. MiB)" in capsys.readouterr().err


def all_parsers():
    """The app's parser and every subcommand's (`pagevis run`, ...), with their nested subparsers."""
    import argparse

    todo, seen = [cli_main.gui_parser(), cli_main.command_parser()], []
    while todo:
        parser = todo.pop()
        seen.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return seen


def test_every_parser_refuses_an_abbreviated_flag():
    """With abbreviations `pagevis --record demo.mp4` was read as `--record-layers demo.mp4` (before --record
    existed); now no parser
    takes a prefix of one of its flags for the flag."""
    parsers = all_parsers()
    assert {p.prog for p in parsers} >= {f"pagevis {c}" for c in cli_main.COMMANDS} | {"pagevis"}
    for parser in parsers:
        assert parser.allow_abbrev is False, parser.prog
        flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--") and len(f) > 4]
        for flag in flags:
            prefix = flag[:-1]
            if prefix not in parser._option_string_actions:
                found = parser._parse_optional(prefix)  # a tuple (3.11), a list of them (3.12.7+), or None
                matches = [found] if isinstance(found, tuple) else (found or [])
                assert all(match[0] is None for match in matches), (parser.prog, prefix)


@pytest.mark.parametrize("argv, words", [
    (["--record-lay", "0"], "pagevis: error: unrecognized arguments: --record-lay 0"),
    (["run", *SYNTH, "--max-tok", "5"], "pagevis run: error: unrecognized arguments: --max-tok 5"),
    (["serve", "--max-run", "2"], "pagevis serve: error: unrecognized arguments: --max-run 2"),
    (["compare", "--budget", "64"], "pagevis compare: error: unrecognized arguments: --budget (see pagevis compare"),
])
def test_a_prefix_of_a_flag_is_an_unknown_flag(capsys, argv, words):
    assert refusal(capsys, *argv).startswith(words)


@pytest.mark.parametrize("argv, words", [
    (["--page-size", "x"], "pagevis: error: argument --page-size: invalid int value: 'x' (see pagevis --help)"),
    (["run", "--page-size", "x"], "pagevis run: error: argument --page-size: invalid int value: 'x'"),
    (["run", *SYNTH, "--prompt", ""], "pagevis run: error: --prompt is empty"),
    (["serve", "--port", "x"], "pagevis serve: error: argument --port: invalid int value: 'x'"),
    (["serve", "--host", "0.0.0.0"], "pagevis serve: error: --host 0.0.0.0 is not a loopback address"),
    (["serve", "--idle-timeout", "0", "--model", "synthetic"],
     "pagevis serve: error: --idle-timeout: idle_timeout = 0.0 is not allowed: a number in (0, 604800]"),
    (["serve", "--token-budget", "-1", "--model", "synthetic"],
     "pagevis serve: error: --token-budget: token_budget = -1 is not allowed: an integer from 1 to 1048576, or 0"),
    (["serve", "--max-pages", "1000", "--model", "synthetic"], "pagevis serve: error: --max-pages: max_pages = "
     "1000 is not allowed: at most 256 pages of 16 tokens (this server's --max-cache-tokens 4096)"),
    (["attach"], "pagevis attach: error: give at least one ENDPOINT"),
    (["bench", "--bogus"], "pagevis bench: error: unrecognized arguments: --bogus (see pagevis bench --help)"),
    (["replay"], "pagevis replay: error: the following arguments are required"),
    (["nonsense"], "pagevis: error: unknown command 'nonsense'"),
])
def test_one_error_form_for_every_command(capsys, argv, words):
    """`PROG: error: MESSAGE`, whether argparse or a later check found the problem."""
    assert refusal(capsys, *argv).startswith(words)

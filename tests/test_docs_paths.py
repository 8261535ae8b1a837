"""The docs name files that exist: every `pagevis/...`, `tests/...` or `scripts/...` path written in backticks in
README.md and docs/*.md is in the repository, and docs/architecture.md's folder table names every package of
pagevis (so a newcomer reading it finds every folder, and no folder it names is gone)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent.name for p in (ROOT / "pagevis").glob("*/__init__.py"))
PATH = re.compile(r"`((?:pagevis|tests|scripts|resources|docs|" + "|".join(PACKAGES) + r")/[\w./-]*)`")


def named_paths(text: str) -> set[str]:
    """Paths in backticks, those that start at a package of pagevis (`kvcache/store.py`) read under pagevis/."""
    found = {match.rstrip(".") for match in PATH.findall(text)}
    return {f"pagevis/{path}" if path.split("/")[0] in PACKAGES else path for path in found}


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in sorted(named_paths(doc.read_text(encoding="utf-8"))):
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def test_the_architecture_table_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    packages = {f"pagevis/{p.parent.relative_to(ROOT / 'pagevis')}/" for p in (ROOT / "pagevis").glob("*/__init__.py")}
    named = {path for path in named_paths(text) if path.endswith("/")}
    assert packages <= named, f"docs/architecture.md does not name {sorted(packages - named)}"


def test_the_check_finds_a_named_path():
    assert named_paths("see `pagevis/kvcache/store.py`, `tests/x.py`, `engine/run_loop.py` and `eng/x.py`") == {
        "pagevis/kvcache/store.py", "tests/x.py", "pagevis/engine/run_loop.py"}

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


README_LINES, README_CHARS = 250, 20_000
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_short():
    """The README gets a newcomer to the window in one screen of text; measurements and reference live in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= README_LINES and len(text) <= README_CHARS, (
        f"README.md is {lines} lines and {len(text):,} characters (at most {README_LINES} and {README_CHARS:,}): "
        "move measurements and long explanations to the docs/*.md they belong to")


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered -1, -2 …"""
    found: set[str] = set()
    fenced = False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n = 0
            while (numbered := slug if n == 0 else f"{slug}-{n}") in found:
                n += 1
            found.add(numbered)
    return found


def test_every_relative_link_resolves():
    """Every Markdown link or picture in README.md and docs/*.md that is not a URL names a file that exists, and
    its #anchor, if any, a heading of that file."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_anchors_follow_github():
    assert anchors("# A `b` (c)\n## The README's two pictures\n```\n# not a heading\n```\n## A `b` (c)") == {
        "a-b-c", "the-readmes-two-pictures", "a-b-c-1"}


def test_the_readme_indexes_every_doc():
    """The README's index of docs/ has a line for every doc, so a newcomer finds each one from the first page."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [doc.name for doc in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{doc.name})" not in text]
    assert not missing, f"README.md's index of docs/ does not link {missing}"

"""Sizes that keep the code readable, enforced for every module of pagevis (beside test_layering.py's arrows): no
function over 80 lines, no class over 400, no module over 600. A failure names each offender and its size.

ALLOWED_OVER names what is still over today, one entry each (the demo issue splits the main window and its
controls, and empties it); an entry that is no longer over fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagevis

ROOT = Path(pagevis.__file__).parent
MAX_FUNCTION, MAX_CLASS, MAX_MODULE = 80, 400, 600

# "path/under/pagevis.py" for a module, "path.py::Class" for a class, "path.py::Class.method" for a function
ALLOWED_OVER: set[str] = set()  # empty: the main window, its controls and the page grid were split by job


def sizes() -> dict[str, tuple[str, int, int]]:
    """Every module, class and function of pagevis: name -> (kind, lines, the most it may have)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        found[module] = ("module", len(text.splitlines()), MAX_MODULE)
        _walk(ast.parse(text), module + "::", found)
    return found


def _walk(node: ast.AST, prefix: str, found: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
            kind, most = ("class", MAX_CLASS) if isinstance(child, ast.ClassDef) else ("function", MAX_FUNCTION)
            found[prefix + child.name] = (kind, child.end_lineno - first + 1, most)
            _walk(child, prefix + child.name + ".", found)
        else:
            _walk(child, prefix, found)


def test_no_function_class_or_module_is_over_its_limit():
    over = [f"{name}: {kind} of {lines} lines (at most {most})" for name, (kind, lines, most) in sizes().items()
            if lines > most and name not in ALLOWED_OVER]
    assert not over, "over the size limits (split them, see docs/architecture.md):\n" + "\n".join(over)


def test_the_allowlist_names_only_what_is_still_over():
    found = sizes()
    stale = [name for name in sorted(ALLOWED_OVER) if name not in found or found[name][1] <= found[name][2]]
    assert not stale, "no longer over its limit (or gone): remove from ALLOWED_OVER in tests/test_sizes.py: " + \
        ", ".join(stale)


def test_the_cache_is_not_on_the_allowlist():
    assert not [name for name in ALLOWED_OVER if name.startswith("kvcache/")]


def test_a_long_function_is_found_by_name(tmp_path):
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 85 + "\n\ndef g():\n    return 1\n"
    found = {}
    _walk(ast.parse(source), "m.py::", found)
    assert found["m.py::A.f"] == ("function", 86, MAX_FUNCTION) and found["m.py::A"][1] == 87
    assert found["m.py::g"] == ("function", 2, MAX_FUNCTION)

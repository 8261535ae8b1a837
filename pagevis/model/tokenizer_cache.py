"""The built tokenizer of a SentencePiece GGUF kept on disk: Gemma's merges are rebuilt from 262,144 tokens
(vocab_tokenizer.merges_by_position), which costs seconds a launch; its tokenizer.json is written once under
<cache>/tokenizers/, named like the weight cache's entries (the file's path, size, mtime), and read back by the
tokenizers library (JSON, no code). A file that fails to parse or whose vocabulary size differs is rebuilt;
at most weight_cache.MAX_ENTRIES files are kept. PAGEVIS_WEIGHT_CACHE=0 turns it off too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from pagevis.model import weight_cache
from pagevis.model.matmul import cache_dir


def cached_backend(source: Path, vocab_size: int, build: Callable[[], Tokenizer]) -> Tokenizer:
    if os.environ.get("PAGEVIS_WEIGHT_CACHE", "1") == "0":
        return build()
    folder, _ = weight_cache.entry_for(source, cache_dir() / "tokenizers")
    path = folder.with_suffix(".json")
    try:
        backend = Tokenizer.from_file(str(path))
        if backend.get_vocab_size(with_added_tokens=True) == vocab_size:
            return backend
    except Exception:  # noqa: BLE001  (missing or damaged: the tokenizers library has its own exception type)
        pass
    backend = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        backend.save(str(temporary))
        temporary.replace(path)
        stale = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in stale[weight_cache.MAX_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
    return backend

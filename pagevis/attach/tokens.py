"""Block text for `--tokenizer FILE`: a Hugging Face tokenizer.json (through the optional `tokenizers` package) or
a GGUF file's own byte-level BPE vocabulary (pagevis.model, no extra package). `load_detokenizer(path)` returns
a function from token ids to text; ValueError with a sentence if the file cannot serve."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

Detokenizer = Callable[[Sequence[int]], str]


def load_detokenizer(path: str | Path) -> Detokenizer:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {path}: no such file")
    if path.suffix.lower() == ".gguf":
        return _gguf(path)
    if path.suffix.lower() == ".json":
        return _hugging_face(path)
    raise ValueError(f"--tokenizer {path}: give a tokenizer.json or a .gguf file")


def _hugging_face(path: Path) -> Detokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer FILE.json needs the tokenizers package: pip install 'pagevis[tokenizers]'") \
            from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions for bad files
        raise ValueError(f"--tokenizer {path}: not a tokenizer.json ({str(error)[:200]})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([i for i in ids if 0 <= i < size], skip_special_tokens=False)
    return decode


def _gguf(path: Path) -> Detokenizer:
    from pagevis.model.errors import ModelLoadError
    from pagevis.model.gguf_file import field_contents, open_gguf, read_metadata
    from pagevis.model.gguf_loader import LONG_ARRAY, tokenizer_from_reader

    try:
        reader = open_gguf(path)
        metadata = read_metadata(reader, skip_arrays_longer_than=LONG_ARRAY)
        vocab = field_contents(reader, "tokenizer.ggml.tokens") if "tokenizer.ggml.tokens" in reader.fields else []
        tokenizer = tokenizer_from_reader(path, reader, metadata, len(vocab))
    except ModelLoadError as error:
        raise ValueError(f"--tokenizer {error}") from None
    size = len(vocab)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([i for i in ids if 0 <= i < size])
    return decode

"""Block text for `--tokenizer FILE`: a Hugging Face tokenizer.json (through the optional `tokenizers` package) or
a GGUF file's own byte-level BPE vocabulary (pagevis.model, no extra package). `load_detokenizer(path)` returns
a function from token ids to text; `load_tokenizer(path)` a `PromptTokenizer` that encodes prompts too (for
`--explain`); ValueError with a sentence if the file cannot serve.

Prompts are encoded as the engine's /v1/completions does: the model's own BOS rule, no chat template (a GGUF:
pagevis serve's `encode(text)`; a tokenizer.json: its post-processor, `add_special_tokens=True`, as vLLM's
tokenizer call). Messages go through the GGUF's chat template; a tokenizer.json carries no template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

Detokenizer = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class PromptTokenizer:
    decode: Detokenizer
    encode: Callable[[str], list[int]]
    encode_chat: Callable[[list[dict]], list[int]] | None  # None: the file has no chat template


def load_detokenizer(path: str | Path) -> Detokenizer:
    return load_tokenizer(path).decode


def load_tokenizer(path: str | Path) -> PromptTokenizer:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {path}: no such file")
    if path.suffix.lower() == ".gguf":
        return _gguf(path)
    if path.suffix.lower() == ".json":
        return _hugging_face(path)
    raise ValueError(f"--tokenizer {path}: give a tokenizer.json or a .gguf file")


def _hugging_face(path: Path) -> PromptTokenizer:
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

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True).ids
    return PromptTokenizer(decode, encode, None)


def _gguf(path: Path) -> PromptTokenizer:
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
    return PromptTokenizer(decode, tokenizer.encode, tokenizer.encode_chat)

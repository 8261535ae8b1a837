"""A trivial tokenizer for the synthetic model: each UTF-8 byte is one token (ids 0-255)."""

from __future__ import annotations

from typing import Iterable

from pagevis.model.chat import format_chatml
from pagevis.model.tokenizer import IncrementalDecoder, printable_token


class ByteTokenizer:
    """Token id == byte value. Has no special tokens: ChatML markers are spelled out byte by byte.

    Ids at or above 256 (a synthetic vocabulary may be larger) decode to no bytes.
    """

    def __init__(self, vocab_size: int = 256) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens: `special` changes nothing

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.format_chat(messages, add_generation_prompt))

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return f"<{token_id}>"
        return printable_token(self.token_bytes(token_id))

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.token_bytes)

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return format_chatml(messages, default_system=None, add_generation_prompt=add_generation_prompt)

"""The tokenizer interface shared by the BPE and byte tokenizers, and streaming UTF-8 decoding."""

from __future__ import annotations

import codecs
from typing import Callable, Iterable, Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for text. Special-token strings in it become their single ids only with special=True."""
        ...

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """A conversation in the model's chat format: control tokens come from the template only."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; bytes that are not valid UTF-8 become U+FFFD."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (may be part of a UTF-8 character)."""
        ...

    def token_text(self, token_id: int) -> str:
        """A printable label for one token, for display."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder:
        """A decoder fed one token at a time (see IncrementalDecoder)."""
        ...

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation in this model's chat format."""
        ...


class IncrementalDecoder:
    """Turns a stream of token ids into text as soon as each character is complete.

    A token may end in the middle of a multi-byte UTF-8 character; its bytes are held back until
    a later token completes the character, so feed() returns "" for it.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        return self._utf8.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back, with an incomplete character shown as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def printable_token(raw: bytes) -> str:
    """Display label for a token's bytes: valid UTF-8 as text, stray bytes as <0xNN>."""
    text = raw.decode("utf-8", errors="surrogateescape")
    return "".join(
        f"<0x{ord(ch) - 0xDC00:02X}>" if 0xDC80 <= ord(ch) <= 0xDCFF else ch for ch in text
    )

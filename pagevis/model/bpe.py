"""GPT-2 style byte-level BPE, built from a GGUF file's tokenizer metadata."""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

import regex

from pagevis.errors import ConfigError
from pagevis.model.chat import SMOLLM2_SYSTEM_PROMPT, chatml_segments, format_chatml
from pagevis.model.tokenizer import IncrementalDecoder, printable_token

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (split every digit off first, word-splitting regex).
# "smollm" is SmolLM2's Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)];
# it is the one checked against reference ids. The Llama 3 entry follows llama.cpp, unverified here.
PRE_TOKENIZERS = {
    "smollm": (True, GPT2_SPLIT),
    "gpt-2": (False, GPT2_SPLIT),
    "default": (False, GPT2_SPLIT),
    "llama-bpe": (False, LLAMA3_SPLIT),
    "llama3": (False, LLAMA3_SPLIT),
}

# GGUF token_type values whose text is matched whole in input (CONTROL, USER_DEFINED).
SPECIAL_TOKEN_TYPES = (3, 4)
WORD_CACHE_LIMIT = 200_000


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (space -> 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


class BPETokenizer:
    """Byte-level BPE: pre-split text into words, map each word's bytes to GPT-2's alphabet, then
    merge adjacent symbols by merge rank until no ranked pair is left. Results are cached per word.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        pre_tokenizer: str = "smollm",
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        chat_system_prompt: str | None = SMOLLM2_SYSTEM_PROMPT,
    ) -> None:
        if pre_tokenizer not in PRE_TOKENIZERS:
            raise ValueError(
                f"pre-tokenizer {pre_tokenizer!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_system_prompt = chat_system_prompt
        self._tokens = list(tokens)
        self._ids = {token: index for index, token in enumerate(tokens)}
        self._ranks = {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(merges)}
        types = token_types or [1] * len(tokens)
        self.special_ids = {
            token: index for index, (token, kind) in enumerate(zip(tokens, types))
            if kind in SPECIAL_TOKEN_TYPES and token  # an empty "special" string would match everywhere
        }
        self._special_split = (
            regex.compile("(" + "|".join(regex.escape(s) for s in
                                          sorted(self.special_ids, key=len, reverse=True)) + ")")
            if self.special_ids else None
        )
        split_digits, word_pattern = PRE_TOKENIZERS[pre_tokenizer]
        self._digit_split = regex.compile(r"(\p{N})") if split_digits else None
        self._word_split = regex.compile(word_pattern)
        self._to_unicode = byte_to_unicode()
        self._to_byte = {char: byte for byte, char in self._to_unicode.items()}
        self._word_cache: dict[str, list[int]] = {}
        self._token_bytes = [self._bytes_of(i) for i in range(len(tokens))]

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for text. With special=True, control-token strings in it (e.g. `<|im_end|>`) become
        their single ids; by default they are text like any other, so user input cannot inject them."""
        return self._bos() + self._encode_text(text, special)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """A conversation in the chat format: control tokens from the template only, messages as text."""
        ids = self._bos()
        for text, control in chatml_segments(messages, self.chat_system_prompt, add_generation_prompt):
            ids += self._encode_text(text, special=control)
        return ids

    def _bos(self) -> list[int]:
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def _encode_text(self, text: str, special: bool) -> list[int]:
        ids = []
        pieces = self._special_split.split(text) if special and self._special_split else [text]
        for index, piece in enumerate(pieces):
            if index % 2:  # odd pieces are the captured special tokens
                ids.append(self.special_ids[piece])
            elif piece:
                for word in self._words(piece):
                    ids.extend(self._encode_word(word))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        special = set(self.special_ids.values()) if skip_special else ()
        raw = b"".join(self.token_bytes(i) for i in ids if i not in special)
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        return printable_token(self._token_bytes[token_id])

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.token_bytes)

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return format_chatml(messages, self.chat_system_prompt, add_generation_prompt)

    def _words(self, text: str) -> Iterable[str]:
        chunks = self._digit_split.split(text) if self._digit_split else [text]
        for chunk in chunks:
            if chunk:
                yield from self._word_split.findall(chunk)

    def _encode_word(self, word: str) -> list[int]:
        cached = self._word_cache.get(word)
        if cached is None:
            symbols = self._merge("".join(self._to_unicode[b] for b in word.encode("utf-8")))
            cached = [token for symbol in symbols for token in self._symbol_ids(symbol)]
            if len(self._word_cache) >= WORD_CACHE_LIMIT:
                self._word_cache.clear()
            self._word_cache[word] = cached
        return cached

    def _symbol_ids(self, symbol: str) -> list[int]:
        """A merged symbol's id; a vocabulary lacking it (never SmolLM2's) falls back to its bytes."""
        if symbol in self._ids:
            return [self._ids[symbol]]
        missing = [ch for ch in symbol if ch not in self._ids]
        if missing:
            byte = self._to_byte[missing[0]]
            raise ConfigError("text", bytes([byte]).decode("latin-1"),
                              f"characters this model's vocabulary can encode (byte {byte:#04x} has no token)")
        return [self._ids[ch] for ch in symbol]

    def _merge(self, spelled: str) -> list[str]:
        symbols = list(spelled)
        ranks = self._ranks
        while len(symbols) > 1:
            best_rank, best_at = None, -1
            for at in range(len(symbols) - 1):
                rank = ranks.get((symbols[at], symbols[at + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, at
            if best_at < 0:
                break
            symbols[best_at:best_at + 2] = [symbols[best_at] + symbols[best_at + 1]]
        return symbols

    def _bytes_of(self, token_id: int) -> bytes:
        token = self._tokens[token_id]
        if token in self.special_ids or any(ch not in self._to_byte for ch in token):
            return token.encode("utf-8")  # special tokens are stored as plain text
        return bytes(self._to_byte[ch] for ch in token)

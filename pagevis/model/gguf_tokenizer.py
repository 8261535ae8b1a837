"""The model's own tokenizer: a `tokenizers.Tokenizer` built from the GGUF vocabulary (vocab_tokenizer.py) behind
pagevis's Tokenizer interface, and the file's chat template (chat_template.py; ChatML when the file has none,
as llama.cpp falls back)."""

from __future__ import annotations

from array import array
from itertools import accumulate
from typing import Callable, Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer as Backend

from pagevis.errors import ConfigError
from pagevis.model.chat import chatml_segments, system_prompt_from_template
from pagevis.model.chat_template import ChatTemplate, ChatTemplateError
from pagevis.model.tokenizer import IncrementalDecoder, printable_token
from pagevis.model.vocab_tokenizer import (CONTROL, SPIECE_SPACE, USER_DEFINED, TokenTypes, byte_to_unicode,
                                           in_byte_alphabet)

BYTE_TOKEN = 6  # GGUF token type BYTE: "<0xNN>" in a SentencePiece vocabulary
# A prompt rendered in the chat template is refused past the model's context, counted as at least MIN_PROMPT_CAP
# (positions beyond a small trained context still work: tiny test models have 64) and at most MAX_PROMPT_TOKENS: a
# template that emits 80,000 control tokens (under its output cap) took 93 s to prefill into a 96-token cache.
MIN_PROMPT_CAP, MAX_PROMPT_TOKENS = 1 << 14, 1 << 15


def prompt_cap(context_length: int) -> int:
    return min(MAX_PROMPT_TOKENS, max(context_length, MIN_PROMPT_CAP))


class GGUFTokenizer:
    """encode / decode / token text over the backend. Token bytes are computed once per id from the vocabulary
    (byte-level: GPT-2's alphabet undone; SentencePiece: U+2581 as a space, <0xNN> as that byte), so streaming
    decode needs no backend call."""

    def __init__(self, backend: Backend | Callable[[], Backend], kind: str, tokens: Sequence[str],
                 token_types: TokenTypes, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 chat_template: str | None) -> None:
        self.kind = kind
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.max_prompt_tokens = MAX_PROMPT_TOKENS  # the loader sets prompt_cap(the model's context)
        types = np.asarray(token_types)
        special = np.flatnonzero((types == CONTROL) | (types == USER_DEFINED)).tolist()
        self.special_ids = {tokens[i]: i for i in special if tokens[i]}
        self._control_ids = {i for t, i in self.special_ids.items() if types[i] == CONTROL}
        self._token_bytes = _token_bytes(kind, tokens, types, set(self.special_ids))
        self._missing_bytes = _bytes_without_token(kind, tokens)
        bos = tokens[bos_id] if bos_id is not None else ""
        eos = tokens[eos_id] if eos_id is not None else ""
        controls = [t for t, i in self.special_ids.items() if i in self._control_ids]
        # a backend given as its builder may take the token strings over (sentencepiece_backend empties tokens)
        self.backend = backend if isinstance(backend, Backend) else backend()
        backend = self.backend
        self._template = ChatTemplate(chat_template, controls, bos, eos) if chat_template else None
        self.chat_system_prompt = system_prompt_from_template(chat_template)  # ChatML's default system turn
        # encode(special=True) reads a second backend whose control-token text is matched: no flag flipped under a
        # lock, so one long encoding never holds up another. It shares the first one's model (vocabulary, merges).
        self._special_backend = _sharing_the_model(backend)
        self._special_backend.encode_special_tokens = False
        # plain encoding spells control-token text as text, so user input cannot inject one; set here for every
        # backend, built or read back from the tokenizer cache (tokenizers does not serialize this flag)
        backend.encode_special_tokens = True

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for text. With special=True, control-token strings in it become their single ids; by default
        they are text like any other, so user input cannot inject them."""
        return self._bos() + self._encode_text(text, special)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """A conversation through the file's template: control tokens from the template only, messages as text."""
        segments = self._segments(messages, add_generation_prompt)
        # Gemma's template starts with {{ bos_token }}: then no second BOS (transformers' and llama.cpp's rule).
        writes_bos = bool(segments) and self._template is not None and segments[0] == (self._template.bos_token, True)
        ids = [] if writes_bos else self._bos()
        for text, control in segments:
            ids += self._encode_text(text, special=control)
            if len(ids) > self.max_prompt_tokens:
                raise ChatTemplateError(f"the conversation in the chat template is more than {self.max_prompt_tokens} "
                                        f"tokens (pagevis's cap: the model's context, at least {MIN_PROMPT_CAP} and "
                                        f"at most {MAX_PROMPT_TOKENS})", bound=True)
        return ids

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(text for text, _ in self._segments(messages, add_generation_prompt))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        skip = self._control_ids if skip_special else ()
        return b"".join(self._token_bytes[i] for i in ids if i not in skip).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        return printable_token(self._token_bytes[token_id])

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.token_bytes)

    def _bos(self) -> list[int]:
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def _segments(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        if self._template is None:
            return chatml_segments(messages, None, add_generation_prompt)
        return self._template.segments(messages, add_generation_prompt)

    def _encode_text(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        if self._missing_bytes:
            missing = sorted(set(text.encode("utf-8")) & self._missing_bytes)
            if missing:
                raise ConfigError("text", bytes(missing[:1]).decode("latin-1"),
                                  f"characters this model's vocabulary can encode (byte {missing[0]:#04x} has no "
                                  "token)")
        backend = self._special_backend if special else self.backend
        # encode_batch lets go of the GIL (encode holds it: 0.3 s for a long prompt stalls every thread)
        return backend.encode_batch([text], add_special_tokens=False)[0].ids


def _sharing_the_model(backend: Backend) -> Backend:
    """A second backend over the same model object (one copy of the vocabulary and merges in memory) with the same
    normalizer, pre-tokenizer, decoder and added tokens (re-added in id order, as Backend.from_str does)."""
    twin = Backend(backend.model)
    twin.normalizer = backend.normalizer
    twin.pre_tokenizer = backend.pre_tokenizer
    twin.post_processor = backend.post_processor
    twin.decoder = backend.decoder
    twin.add_tokens([token for _, token in sorted(backend.get_added_tokens_decoder().items())])
    return twin


class _TokenBytes:
    """Every token's bytes in one bytes object with an array of where each begins: indexed like a list of them
    (a list of Gemma's 262,144 bytes objects took ~15 MiB)."""

    def __init__(self, blob: bytes, lengths: Iterable[int]):
        self._blob = blob
        self._starts = array("q", accumulate(lengths, initial=0))
        self._count = len(self._starts) - 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> bytes:
        if not -self._count <= index < self._count:
            raise IndexError("token id out of range")
        index = int(index) % self._count
        return self._blob[self._starts[index]:self._starts[index + 1]]


def _token_bytes(kind: str, tokens: Sequence[str], token_types: np.ndarray, plain: set[str]) -> _TokenBytes:
    if kind == "gpt2":
        return _byte_level_bytes(tokens, plain)
    pieces = [token.replace(SPIECE_SPACE, " ").encode("utf-8") for token in tokens]
    for index in np.flatnonzero(token_types == BYTE_TOKEN).tolist():
        token = tokens[index]
        if len(token) == 6 and token.startswith("<0x"):
            pieces[index] = bytes([int(token[3:5], 16)])
    return _TokenBytes(b"".join(pieces), map(len, pieces))


def _byte_level_bytes(tokens: Sequence[str], plain: set[str]) -> _TokenBytes:
    """GPT-2's alphabet undone (one byte a character), for whole runs of tokens at once; a token in plain (control
    text) or with a character outside the alphabet is its UTF-8 as it stands."""
    undo = str.maketrans({char: chr(byte) for byte, char in byte_to_unicode().items()})
    lengths = list(map(len, tokens))
    outside = [i for i, t in enumerate(tokens) if t in plain]
    if not in_byte_alphabet("".join(tokens)):
        outside = [i for i, t in enumerate(tokens) if t in plain or not in_byte_alphabet(t)]
    parts, start = [], 0
    for index in outside:
        parts.append("".join(tokens[start:index]).translate(undo).encode("latin-1"))
        parts.append(tokens[index].encode("utf-8"))
        lengths[index] = len(parts[-1])
        start = index + 1
    parts.append("".join(tokens[start:]).translate(undo).encode("latin-1"))
    return _TokenBytes(b"".join(parts), lengths)


def _bytes_without_token(kind: str, tokens: Sequence[str]) -> set[int]:
    """Bytes a byte-level vocabulary cannot spell (SmolLM2 lacks a few); SentencePiece falls back to <0xNN>."""
    if kind != "gpt2":
        return set()
    known = set(tokens)
    return {byte for byte, char in byte_to_unicode().items() if char not in known}

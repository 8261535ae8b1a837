"""A Hugging Face `tokenizers.Tokenizer` built from a GGUF file's vocabulary, the two kinds llama.cpp writes.

- "gpt2": byte-level BPE with the file's merges. Text is split by the regex of `tokenizer.ggml.pre` (as llama.cpp
  and transformers' GGUF loader split it), then spelled in GPT-2's byte alphabet. "smollm" keeps SmolLM2's own
  tokenizer.json rule (every digit split off first), checked against its reference ids.
- "llama": SentencePiece BPE with byte fallback (Gemma's). The file has no merges: as transformers' GGUF loader
  does, they are rebuilt from the vocabulary (every split of a token into two tokens), ordered by the position of
  the merged token in the file; spaces become U+2581 and tokens spelled with real spaces are respelled with it.

Control tokens (GGUF type 3) are special added tokens, matched whole only when the caller asks (GGUFTokenizer
sets the backend's encode_special_tokens, so plain encoding spells them as text); user-defined ones (type 4, e.g.
Gemma's newline runs) are added tokens matched whole always, as llama.cpp does.
"""

from __future__ import annotations

import collections.abc
from array import array
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex (None: GPT-2's own, inside ByteLevel); "smollm" adds SmolLM2's digit split.
PRE_TOKENIZER_SPLITS = {
    "smollm": None, "gpt-2": None, "default": None,
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}
# Rebuilding merges slices every token at every cut: sum(len(token)^2) work. Gemma's vocabulary needs 1.1e7;
# a file asking for more than this bound (long tokens crafted to stall the loader) is refused.
MAX_MERGE_WORK = 200_000_000
CONTROL, USER_DEFINED = 3, 4
SPIECE_SPACE = "\u2581"
TOKENIZER_KINDS = ("gpt2", "llama")
# (rebuild, spelled) -> the merges as token-id pairs: tokenizer_cache.cached_merges with its file (checked by
# spelled(ids): does every pair spell a token?), or rebuild().
# a vocabulary's GGUF token types: the file's numbers as one ndarray, or a list of ints
TokenTypes = Sequence[int] | np.ndarray
CachedMerges = Callable[[Callable[[], np.ndarray], Callable[[np.ndarray], bool]], np.ndarray]


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


@lru_cache(maxsize=1)
def _drop_byte_alphabet() -> dict[int, None]:
    return dict.fromkeys(map(ord, byte_to_unicode().values()))


def in_byte_alphabet(text: str) -> bool:
    """Whether every character of text is one of GPT-2's 256 byte characters (one C pass over text)."""
    return not text.translate(_drop_byte_alphabet())


def byte_level_backend(tokens: Sequence[str], merges: Sequence[str], token_types: TokenTypes,
                       pre: str) -> Tokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                         f"(supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
    alphabet = set(byte_to_unicode().values())
    spelled = byte_to_unicode()
    if in_byte_alphabet("".join(tokens)):  # every token spelled in the alphabet (SmolLM2's): each its own key
        vocab = _first_ids(tokens)
    else:
        vocab = {}
        for index, token in enumerate(tokens):
            # A control token written in plain text (<|im_start|> is, in GPT-2's alphabet already) stays as it is.
            key = token if set(token) <= alphabet else "".join(spelled[b] for b in token.encode("utf-8"))
            vocab.setdefault(key, index)
    # a merge without a space goes as a 1-tuple, which the library refuses (its stub types pairs only)
    backend = Tokenizer(models.BPE(vocab, _merge_pairs(vocab, merges), ignore_merges=False))  # type: ignore[arg-type]
    del vocab  # the model holds its own copy
    split = PRE_TOKENIZER_SPLITS[pre]
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    _add_control_tokens(backend, tokens, token_types, lambda token: set(token) <= alphabet)
    return backend


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, a repeated token mapped to its first id (setdefault's result, built in one C pass)."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))


def _merge_pairs(vocab: dict[str, int], merges: Sequence[str]) -> list[tuple[str, str] | tuple[str]]:
    """The file's merges ("left right") as pairs holding the vocabulary's own string objects where the pieces are
    tokens (a piece that is not stays a new string: the tokenizers library then refuses the merge)."""
    same = {token: token for token in vocab}
    pairs: list[tuple[str, str] | tuple[str]] = []
    for index, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if space and left + right not in same:  # the tokenizers library panics (a BaseException) on such a merge
            raise ValueError(f"tokenizer.ggml.merges: merge {index} ({merge!r}) makes {left + right!r}, which is not "
                             f"a token of the vocabulary")
        pairs.append((same.get(left, left), same.get(right, right)) if space else (merge,))
    return pairs


def sentencepiece_backend(tokens: list[str], token_types: TokenTypes, add_space_prefix: bool,
                          cached_merges: CachedMerges = lambda rebuild, spelled: rebuild()) -> Tokenizer:
    """The SentencePiece BPE of this vocabulary. Its merges are rebuilt from the vocabulary (merges_by_position), as
    token-id pairs: cached_merges(rebuild) returns them, read from tokenizer_cache.py's file or made by rebuild.

    It takes the token strings over: `tokens` is emptied once the tokenizers library has read the vocabulary and
    the merges, before it builds its own tables from them, so that the strings and the dict (~50 MiB for Gemma)
    are not held through that build's peak. The caller reads what it needs from them first."""
    work = sum(len(t) ** 2 for t in tokens)
    if work > MAX_MERGE_WORK:
        raise ValueError(f"tokenizer.ggml.tokens: rebuilding this vocabulary's merges takes {work:.3g} steps (the "
                         f"sum of squared token lengths), more than the {MAX_MERGE_WORK:.3g} pagevis allows")
    respelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    unknown, added = _unknown(tokens, token_types), _added_tokens(respelled, token_types, lambda token: True)

    def release() -> None:
        tokens.clear()
        respelled.clear()

    backend = Tokenizer(_sentencepiece_model(respelled, unknown, cached_merges, release))
    steps = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    _add_tokens(backend, *added)
    return backend


def _sentencepiece_model(respelled: list[str], unknown: str | None, cached_merges: CachedMerges,
                         release: Callable[[], None]) -> models.BPE:
    """The BPE model. The vocabulary dict is emptied and release() called once models.BPE has read the dict and
    every merge (it reads its arguments in order, then builds): checked by the model's vocabulary size."""
    vocab = _first_ids(respelled)
    distinct = len(vocab)

    def read() -> None:
        vocab.clear()
        release()

    merges = _MergePairs(respelled, cached_merges(lambda: merges_by_position(respelled, vocab),
                                                  lambda ids: in_merge_order(respelled, vocab, ids)), read)
    model = models.BPE(vocab, merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    if Tokenizer(model).get_vocab_size(with_added_tokens=False) != distinct:
        raise RuntimeError(f"the tokenizers library read the vocabulary after its merges: this version of it "
                           f"({tokenizers.__version__}) needs vocab_tokenizer._sentencepiece_model changed")
    return model


class _MergePairs(collections.abc.Sequence):
    """Merges given as token-id pairs, seen as the (left, right) string pairs models.BPE reads, made one at a time
    while it reads them (515k tuples for Gemma held at once would cost ~40 MiB more at the build's peak); read() is
    called once they have all been read."""

    def __init__(self, names: Sequence[str], ids: np.ndarray, read: Callable[[], None]):
        self.names, self.read = names, read
        self.left, self.right = (np.ascontiguousarray(ids[:, side]).data for side in (0, 1))

    def __len__(self) -> int:
        return len(self.left)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.names[self.left[index]], self.names[self.right[index]]

    def __iter__(self):
        yield from zip(map(self.names.__getitem__, self.left), map(self.names.__getitem__, self.right))
        self.read()


# Bytes UTF-8 text can hold (a Python str encodes to no others): what a byte fallback must be able to spell.
UTF8_BYTES = (*range(0xC0), *range(0xC2, 0xF5))


def check_spellable(tokens: Sequence[str], token_types: TokenTypes) -> None:
    """Refuse a SentencePiece vocabulary that would drop characters without a word: ValueError (one line) when it
    has no unknown token and some byte of UTF-8 text has no way to be spelled.

    A character with no piece falls back to its bytes' <0xNN> tokens; where one is missing SentencePiece emits
    <unk> (it refuses to load a model without one), and llama.cpp (llama_vocab::byte_to_token) tries the byte
    as a one-character piece and otherwise throws mid-tokenisation. So with an unknown token nothing is lost
    (the <unk> shows); without one, every byte needs <0xNN> or, for ASCII, its own piece (a space: U+2581, what
    it becomes before tokenising) -- else text with that byte would silently lose it, and the file is refused."""
    if _unknown(tokens, token_types) is not None:
        return
    known = set(tokens)
    byte_token = {b: f"<0x{b:02X}>" for b in range(256)}

    def spelled(b: int) -> bool:
        if byte_token[b] in known:
            return True
        if b == 0x20:
            return SPIECE_SPACE in known or all(byte_token[x] in known for x in SPIECE_SPACE.encode())
        return b < 0x80 and chr(b) in known

    missing = [b for b in UTF8_BYTES if not spelled(b)]
    if missing:
        raise ValueError(f"tokenizer.ggml.tokens: this SentencePiece vocabulary has no unknown token (type 2) and "
                         f"cannot spell {len(missing)} bytes of UTF-8 text (e.g. {byte_token[missing[0]]}, no byte "
                         "token nor piece): text holding them would be lost, so it is refused (SentencePiece "
                         "refuses a model without <unk>)")


def merges_by_position(tokens: Sequence[str], vocab: dict[str, int]) -> np.ndarray:
    """Every (left, right) pair of tokens that spells a token, as an int32 (n, 2) array of their ids: the merged
    token's earlier place in the file first, then the longer left piece (transformers' generate_merges with Gemma's
    position scores). Walking the tokens in file order (a repeated one at its first place, where vocab has it) and
    each token's cuts from the right yields that order without a sort. Ids, not strings: Gemma's 515k pairs of new
    strings took ~90 MiB."""
    ids = array("i")
    for index, merged in enumerate(tokens):
        if vocab[merged] != index:
            continue
        for cut in range(len(merged) - 1, 0, -1):
            left, right = vocab.get(merged[:cut]), vocab.get(merged[cut:])
            if left is not None and right is not None:
                ids.append(left)
                ids.append(right)
    return np.frombuffer(ids, dtype=np.int32).reshape(-1, 2).copy()


def in_merge_order(tokens: Sequence[str], vocab: dict[str, int], ids: np.ndarray) -> bool:
    """Whether ids could be merges_by_position's: every pair spells a token (one that spells none makes the
    tokenizers library panic), in its order (the merged token's place, then the longer left piece first: reordered
    merges tokenize differently). ~0.2 s for Gemma's 515k pairs, on a cached file only."""
    last, last_left = -1, 0
    for left, right in ids.tolist():
        merged = vocab.get(tokens[left] + tokens[right])
        if merged is None or merged < last or (merged == last and len(tokens[left]) >= last_left):
            return False
        last, last_left = merged, len(tokens[left])
    return True


def _unknown(tokens: Sequence[str], token_types: TokenTypes) -> str | None:
    unknown = np.flatnonzero(np.asarray(token_types) == 2)  # GGUF type 2: UNKNOWN
    return tokens[unknown[0]] if unknown.size else None


def _add_control_tokens(backend: Tokenizer, tokens: Sequence[str], token_types: TokenTypes, spellable) -> None:
    _add_tokens(backend, *_added_tokens(tokens, token_types, spellable))


def _added_tokens(tokens: Sequence[str], token_types: TokenTypes, spellable) -> tuple[list[str], list[str]]:
    """(control tokens that can be spelled, user-defined tokens), in id order."""
    types = np.asarray(token_types)
    control = [tokens[i] for i in np.flatnonzero(types == CONTROL).tolist() if tokens[i] and spellable(tokens[i])]
    return control, [tokens[i] for i in np.flatnonzero(types == USER_DEFINED).tolist()]


def _add_tokens(backend: Tokenizer, control: list[str], user: list[str]) -> None:
    """Control tokens as special added tokens; user-defined ones the vocabulary has as plain added tokens."""
    known = [AddedToken(t, normalized=False, special=False) for t in user if backend.token_to_id(t) is not None]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens(known)

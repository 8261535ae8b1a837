"""The byte-level BPE tokenizer against reference ids, special tokens, streaming decode, speed."""

from __future__ import annotations

import time

import pytest

from pagevis.model import ByteTokenizer

from model_fixtures import reference, smollm2  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def test_ids_equal_reference(tokenizer, reference):
    for case in reference["strings"]:
        assert tokenizer.encode(case["text"], special=True) == case["ids"], case["text"]  # transformers parses them


def test_decode_round_trips_reference_strings(tokenizer, reference):
    for case in reference["strings"]:
        assert tokenizer.decode(case["ids"]) == case["text"]


def test_digits_are_split_one_by_one(tokenizer):
    pieces = [tokenizer.token_text(i) for i in tokenizer.encode("12345 3.14")]
    assert pieces == ["1", "2", "3", "4", "5", " ", "3", ".", "1", "4"]


def test_special_tokens_in_text_are_single_ids_only_when_asked(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>", special=True)[0] == 1
    assert tokenizer.encode("<|im_end|>", special=True) == [2]
    assert tokenizer.encode("<|endoftext|>", special=True) == [0]
    plain = tokenizer.encode("<|im_end|>")
    assert len(plain) > 1 and not set(plain) & set(tokenizer.special_ids.values())
    assert tokenizer.decode(plain) == "<|im_end|>"
    assert tokenizer.decode([1, 2]) == "<|im_start|><|im_end|>"
    assert tokenizer.decode([1, 2], skip_special=True) == ""


def test_incremental_decoder_waits_for_complete_characters(tokenizer):
    text = "a😀b日本"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert any(_is_partial_utf8(p) for p in pieces), "test needs a token ending mid-character"
    decoder = tokenizer.incremental_decoder()
    emitted = [decoder.feed(i) for i in ids]
    assert "".join(emitted) + decoder.flush() == text
    assert all("\ufffd" not in chunk for chunk in emitted)
    for raw, chunk in zip(pieces, emitted):
        if _is_partial_utf8(raw) and chunk == "":
            break
    else:
        pytest.fail("no token was held back")


def test_incremental_decoder_flushes_an_unfinished_character(tokenizer):
    emoji_ids = tokenizer.encode("😀")
    decoder = tokenizer.incremental_decoder()
    assert decoder.feed(emoji_ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_token_text_shows_stray_bytes(tokenizer):
    partial = next(i for i in tokenizer.encode("😀") if _is_partial_utf8(tokenizer.token_bytes(i)))
    assert tokenizer.token_text(partial).startswith("<0x")
    assert tokenizer.token_text(tokenizer.encode(" hello")[0]) == " hello"


def test_encoding_a_few_thousand_words_is_fast(tokenizer):
    words = [f"word{i} the quick brown fox jumps over the lazy dog; café, naïve, 東京 {i * 7}" for i in range(300)]
    text = "\n".join(words)  # ~4,000 words
    start = time.perf_counter()
    ids = tokenizer.encode(text)
    elapsed = time.perf_counter() - start
    assert tokenizer.decode(ids) == text
    assert elapsed < 0.5, f"encoding took {elapsed:.2f} s"


def test_chat_format_uses_the_gguf_default_system_prompt(tokenizer):
    prompt = tokenizer.format_chat([{"role": "user", "content": "hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = tokenizer.format_chat([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert own_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_the_special_token_backend_is_the_same_tokenizer_but_for_control_text(tokenizer):
    """encode(special=True) reads a second backend over the same model: its whole configuration (vocabulary, merges,
    pre-tokenizer, decoder, added tokens) serializes as the first one's does; only the control-text flag differs."""
    assert tokenizer._special_backend.to_str() == tokenizer.backend.to_str()
    assert tokenizer.backend.encode_special_tokens and not tokenizer._special_backend.encode_special_tokens


def test_token_bytes_index_like_a_list(tokenizer):
    last = tokenizer.vocab_size - 1
    assert tokenizer.token_bytes(-1) == tokenizer.token_bytes(last) and tokenizer.token_bytes(0) == b"<|endoftext|>"
    assert tokenizer.token_bytes(tokenizer.encode(" hello")[0]) == b" hello"
    for outside in (tokenizer.vocab_size, -tokenizer.vocab_size - 1):
        with pytest.raises(IndexError):
            tokenizer.token_bytes(outside)


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "héllo\t世界 😀 <|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    decoder = tokenizer.incremental_decoder()
    assert "".join(decoder.feed(i) for i in ids) == text
    assert tokenizer.token_text(0xE4) == "<0xE4>" and tokenizer.token_text(65) == "A"


def _is_partial_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False

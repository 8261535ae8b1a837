"""RoPE scaling read as llama.cpp reads it (pagevis/model/rope_scaling.py): tiny Llama files whose metadata asks for
linear scaling in each way llama.cpp accepts (scripts/make_rope_scaling_reference.py wrote them and transformers'
logits for them) give transformers' logits; scaling types pagevis does not compute are refused with one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pagevis.model import DenseAttention, ModelLoadError, load_model
from pagevis.model.decoder import DecoderModel

DATA = Path(__file__).parent / "data" / "rope-scaling"
REFERENCE = json.loads((DATA / "reference.json").read_text())
CASES = REFERENCE["cases"]


def logits_of(model) -> np.ndarray:
    ids = np.array(REFERENCE["ids"])
    return model.forward(ids, np.arange(len(ids)), DenseAttention(model.config), all_logits=True)[REFERENCE["rows"]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_transformers(name):
    case = CASES[name]
    model = load_model(DATA / case["file"])
    assert model.config.rope_scale == (case["scaling"][1] if case["scaling"] else 1.0)
    np.testing.assert_allclose(logits_of(model), np.array(case["logits"]), rtol=1e-4, atol=2e-4)


def test_the_scaling_changes_the_answer():
    """The four Llama files hold the same weights: the references differ only by the scaling, and by a lot."""
    plain = np.array(CASES["none-type"]["logits"])
    for name in ("factor-no-type", "scale-linear", "linear-type"):
        assert np.abs(np.array(CASES[name]["logits"]) - plain).max() > 0.1, name
    model = load_model(DATA / "factor-no-type.gguf")
    unscaled = DecoderModel(replace(model.config, rope_scale=1.0, rope_scales=()), model.weights, None)
    np.testing.assert_allclose(logits_of(unscaled), plain, rtol=1e-4, atol=2e-4)


def test_gemma3_scales_only_its_global_layer():
    """Gemma 3 (the 4B-27B scale by 8): llama.cpp and transformers scale the global layers and never the local ones.
    Scaling every layer, or none, gives other logits than transformers'."""
    model = load_model(DATA / "gemma3-linear.gguf")
    assert model.config.rope_scales == (1.0, 1.0, 1.0, 1.0, 1.0, 8.0)
    reference = np.array(CASES["gemma3-linear"]["logits"])
    for scales in ((8.0,) * 6, (1.0,) * 6):
        wrong = DecoderModel(replace(model.config, rope_scales=scales), model.weights, None)
        assert np.abs(logits_of(wrong) - reference).max() > 0.05, scales


def rewritten(tmp_path: Path, changes: dict) -> Path:
    """factor-no-type.gguf with its metadata changed (value None: the key removed)."""
    import gguf

    from pagevis.model.gguf_file import field_contents, open_gguf

    reader = open_gguf(DATA / "factor-no-type.gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field_contents(reader, key))
        else:
            writer.add_key_value(key, field_contents(reader, key), kind)
    for key, value in changes.items():
        if value is not None:
            kind = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.FLOAT32
            writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("changes, says", [
    ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type is 'yarn' (llama.cpp's); pagevis computes none and linear"),
    ({"llama.rope.scaling.type": "longrope"}, "'longrope' (llama.cpp's)"),
    ({"llama.rope.scaling.type": "dynamic"}, "'dynamic' (not one of llama.cpp's)"),
    ({"llama.rope.scaling.factor": -2.0}, "llama.rope.scaling.factor is -2.0, expected a positive number"),
    ({"llama.rope.scaling.factor": float("nan")}, "llama.rope.scaling.factor is nan, expected a finite number"),
    ({"llama.rope.scaling.factor": None, "llama.rope.scale_linear": float("inf")}, "llama.rope.scale_linear is inf, expected a finite number"),
    ({"llama.rope.scaling.attn_factor": 2.0}, "llama.rope.scaling.attn_factor is 2.0"),
    ({"llama.rope.scaling.factor": "eight"}, "llama.rope.scaling.factor is str 'eight', expected a number"),
])
def test_unsupported_scaling_is_refused_naming_the_key(tmp_path, changes, says):
    path = rewritten(tmp_path, changes)
    with pytest.raises(ModelLoadError) as refused:
        load_model(path)
    message = str(refused.value)
    assert says in message and message.count(str(path)) == 1 and "\n" not in message, message


def test_factor_wins_over_the_old_key_and_zero_means_unscaled(tmp_path):
    both = load_model(rewritten(tmp_path, {"llama.rope.scale_linear": 4.0}))
    assert both.config.rope_scale == 8.0  # llama.cpp reads scale_linear only when scaling.factor is absent
    zero = load_model(rewritten(tmp_path, {"llama.rope.scaling.factor": 0.0}))
    assert zero.config.rope_scale == 1.0 and not zero.config.rope_scaled


def test_rerotation_refuses_a_scaled_model():
    """The cache's re-rotation redoes RoPE with plain frequencies: a scaled model is refused, not mis-rotated."""
    from pagevis.errors import ConfigError
    from pagevis.kvcache.config import CacheConfig, CacheSettings

    model = load_model(DATA / "linear-type.gguf")
    settings = CacheSettings(page_size=4, max_pages=8, policy="h2o", policy_params={"rerotate": 1})
    with pytest.raises(ConfigError, match="rerotate.*scales its RoPE"):
        CacheConfig.for_model(settings, model.config)
    CacheConfig.for_model(settings, load_model(DATA / "none-type.gguf").config)

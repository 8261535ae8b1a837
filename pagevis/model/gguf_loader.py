"""Building a LlamaModel (config, float32 weights, tokenizer) from a GGUF file."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .bpe import BPETokenizer
from .chat import system_prompt_from_template
from .config import ModelConfig
from .errors import ModelConfigError, ModelLoadError
from .gguf_file import open_gguf, read_metadata, tensor_as_float32
from .llama import LlamaModel
from .locate import default_model_path
from .weights import LlamaWeights, layer_from_gguf_matrices

SUPPORTED_ARCHITECTURE = "llama"
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Metadata arrays longer than this (the vocabulary, merges) are read only when building the tokenizer.
LONG_ARRAY = 64


def load_model(path: str | Path | None = None) -> LlamaModel:
    """Load a Llama-family GGUF file (default: SmolLM2-135M-Instruct) with weights as float32."""
    path = default_model_path() if path is None else Path(path)
    reader = open_gguf(path)
    metadata = read_metadata(reader, skip_arrays_longer_than=LONG_ARRAY)
    config = config_from_metadata(path, metadata, reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    weights = weights_from_tensors(path, config, tensors)
    return LlamaModel(config, weights, tokenizer_from_reader(path, reader, metadata))


def config_from_metadata(path: Path, metadata: dict[str, Any], reader: Any) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: metadata has no general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; pagevis runs Llama-family models "
            f"(general.architecture = {SUPPORTED_ARCHITECTURE!r})"
        )
    _refuse_rope_scaling(path, metadata, reader)

    def required(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ModelLoadError(f"{path}: metadata key {arch}.{key} is missing")
        return metadata[f"{arch}.{key}"]

    d_model = required("embedding_length")
    n_heads = required("attention.head_count")
    head_dim = metadata.get(f"{arch}.attention.key_length", d_model // max(n_heads, 1))
    rope_dims = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    vocab = metadata.get(f"{arch}.vocab_size") or _vocab_from_embedding(path, reader)
    eos_ids = tuple(dict.fromkeys(
        int(metadata[key]) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if key in metadata
    ))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            name=path.stem,
            n_layers=required("block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=metadata.get(f"{arch}.attention.head_count_kv", n_heads),
            head_dim=head_dim,
            d_ff=required("feed_forward_length"),
            vocab_size=vocab,
            rope_base=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=required("context_length"),
            bos_id=None if bos is None else int(bos),
            eos_ids=eos_ids,
        )
    except ModelConfigError as exc:
        raise ModelLoadError(f"{path}: inconsistent metadata: {exc}") from exc


def _refuse_rope_scaling(path: Path, metadata: dict[str, Any], reader: Any) -> None:
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"{path}: RoPE scaling ({scaling}) is not supported")


def _vocab_from_embedding(path: Path, reader: Any) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")


def weights_from_tensors(path: Path, config: ModelConfig, tensors: dict[str, Any]) -> LlamaWeights:
    """Dequantise and lay out every weight. Two threads: NumPy releases the GIL in the bulk work."""
    expected = _expected_shapes(config, tied="output.weight" not in tensors)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{path}: unexpected tensor {unexpected[0]} for a Llama model (ignoring it would compute "
            f"something other than what the file describes)"
        )

    def dense(name: str) -> np.ndarray:
        return tensor_as_float32(path, tensors[name], expected[name])

    def layer(index: int):
        return layer_from_gguf_matrices(*(dense(f"blk.{index}.{part}.weight") for part in LAYER_TENSORS))

    def output() -> tuple[np.ndarray, np.ndarray]:
        embedding = dense("token_embd.weight")
        if "output.weight" not in tensors:
            output_t = np.ascontiguousarray(embedding.T)
            return output_t.T, output_t  # tied: one copy, read row-wise for lookup
        return embedding, np.ascontiguousarray(dense("output.weight").T)

    with ThreadPoolExecutor(max_workers=2) as pool:
        output_job = pool.submit(output)
        layers = tuple(pool.map(layer, range(config.n_layers)))
        embedding, output_t = output_job.result()
    return LlamaWeights(embedding, layers, dense("output_norm.weight").copy(), output_t)


def _expected_shapes(config: ModelConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    d, q, kv, ff = config.d_model, config.q_dim, config.kv_dim, config.d_ff
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    if not tied:
        shapes["output.weight"] = (config.vocab_size, d)
    per_layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d),
                 "attn_output": (d, q), "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d),
                 "ffn_down": (d, ff)}
    for index in range(config.n_layers):
        shapes.update({f"blk.{index}.{part}.weight": shape for part, shape in per_layer.items()})
    return shapes


def tokenizer_from_reader(path: Path, reader: Any, metadata: dict[str, Any]) -> BPETokenizer | None:
    """The file's byte-level BPE tokenizer, or None if the file carries no tokenizer."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported; pagevis reads byte-level BPE ('gpt2')"
        )

    def array(key: str) -> list[Any] | None:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    tokens = array("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens is missing")
    merges = array("tokenizer.ggml.merges") or []  # a byte-only vocabulary needs none
    template = metadata.get("tokenizer.chat_template")
    try:
        return BPETokenizer(
            tokens, merges, array("tokenizer.ggml.token_type"),
            pre_tokenizer=metadata.get("tokenizer.ggml.pre", "default"),
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_system_prompt=system_prompt_from_template(template),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc

"""Building a DecoderModel (config, float32 weights, tokenizer) from a GGUF file of a registered architecture."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType
from tokenizers import Tokenizer

from pagevis.system_memory import available_bytes, fits, gib
from pagevis.model import weight_cache
from pagevis.model.architectures import architecture_of
from pagevis.model.blas_threads import set_blas_threads
from pagevis.model.chat_template import ChatTemplateError
from pagevis.model.config import ModelConfig
from pagevis.model.errors import ModelConfigError, ModelLoadError
from pagevis.model.gguf_file import (check_tensor, field_values, open_gguf, read_metadata, release_metadata_pages,
                                    release_pages, tensor_as_float32)
from pagevis.model.gguf_tokenizer import GGUFTokenizer, prompt_cap
from pagevis.model.decoder import DecoderModel
from pagevis.model.locate import default_model_path
from pagevis.model.matmul import plan_for
from pagevis.model.metadata_keys import check_every_key_honoured
from pagevis.model.rope_scaling import linear_factor
from pagevis.model.tokenizer_cache import cached_merges
from pagevis.model.vocab_tokenizer import (TOKENIZER_KINDS, byte_level_backend, byte_to_unicode, check_spellable,
                                           sentencepiece_backend)
from pagevis.model.quant_weights import held_bytes, quantized_weights, weight_format
from pagevis.model.quantized import kernels, preload_matrices, spin_pool
from pagevis.model.resident import release_freed_heap
from pagevis.model.weights import DecoderWeights, check_weight_shapes, layer_from_gguf_matrices

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Tensors a layer has only in some layouts: config.Layout field -> {layer_from_gguf_matrices argument: GGUF name}.
OPTIONAL_LAYER_TENSORS = {
    "qkv_bias": {"q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias"},
    "qk_norm": {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"},
    "post_norms": {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight"},
}
ROPE_FREQS = "rope_freqs.weight"
# Byte tokens every vocabulary must have: text is made of them. (SmolLM2 lacks a few control characters
# and bytes that never occur in UTF-8; encoding text with those is refused when it happens.)
REQUIRED_BYTES = (0x09, 0x0A, *range(0x20, 0x7F))
# Metadata arrays longer than this (the vocabulary, merges) are read only when building the tokenizer.
LONG_ARRAY = 64


def load_model(path: str | Path | None = None, weights: str | None = None) -> DecoderModel:
    """Load a GGUF file of a registered architecture (default: SmolLM2-135M-Instruct), its matrices kept as the file
    stores them (weights "quantized", the default: quant_weights.py) or dequantised to float32 ("float32")."""
    fmt = weights or weight_format()
    path = default_model_path() if path is None else Path(path)
    reader = open_gguf(path)
    metadata = read_metadata(reader, skip_arrays_longer_than=LONG_ARRAY)
    config = config_from_metadata(path, metadata, reader, float32=fmt == "float32")
    tokenizer = tokenizer_from_reader(path, reader, metadata, config.vocab_size)  # before the weights: fail fast
    bound_prompts(path, tokenizer, config.context_length)
    release_metadata_pages(reader)
    release_freed_heap()
    types = dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))
    if fmt == "float32":
        held = cached_or_dequantised_weights(path, config, reader)
        model = DecoderModel(config, held, tokenizer, plan=plan_for(held.matrices()))
    else:
        kernels()  # compiled (first launch) or loaded from numba's cache now, not in the first step
        spin_pool()  # likewise the second thread's (with two threads)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        expected = check_tensor_names(path, config, tensors)
        optional = {argument: name for field, parts in OPTIONAL_LAYER_TENSORS.items()
                    if getattr(config.layout, field) for argument, name in parts.items()}
        held = quantized_weights(path, tensors, lambda name: tensor_as_float32(path, tensors[name], expected[name]),
                                 config.n_layers, LAYER_TENSORS, optional, lambda t: release_pages(reader, t))
        preload_matrices(held.matrices())  # their families' kernels, likewise
        model = DecoderModel(config, held, tokenizer)
        # Products with these weights run on the weight threads (weight_threads.py), which never wait for a busy
        # core; BLAS (prefill's sgemm chunks, attention) stays on one thread per caller: two spinning OpenBLAS
        # threads made a SmolLM2 prefill 13 s instead of 1 s on a busy machine (issue 37's 30 s first step).
        set_blas_threads(1)
    model.weight_info = {"format": fmt, "types": types, "bytes": held_bytes(held)}
    return model


def bound_prompts(path: Path, tokenizer: GGUFTokenizer, context_length: int) -> None:
    """Prompts in the chat template are refused past gguf_tokenizer.prompt_cap (the model's context, within fixed
    bounds); a template that makes a one-line conversation longer than that is refused now, not after minutes of
    prefill."""
    tokenizer.max_prompt_tokens = prompt_cap(context_length)
    try:
        tokenizer.encode_chat([{"role": "user", "content": "Hello, how are you?"}])
    except ChatTemplateError as error:
        if error.bound:
            raise ModelLoadError(f"{path}: {error}") from None  # one that raises on this may render real ones


def cached_or_dequantised_weights(path: Path, config: ModelConfig, reader: Any) -> DecoderWeights:
    """The weights from the on-disk cache (weight_cache.py) when it has a valid entry with the shapes this config
    implies, else dequantised from the file (and stored for next time)."""
    use_cache = weight_cache.enabled(config.weight_bytes())
    cached = weight_cache.load(path) if use_cache else None
    if cached is not None:
        try:
            check_weight_shapes(config, cached)
            return cached
        except ValueError:
            pass
    weights = weights_from_tensors(path, config, {tensor.name: tensor for tensor in reader.tensors})
    if use_cache:
        weight_cache.store(path, weights)
    return weights


_MISSING = object()
_KINDS = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false"}


def metadata_value(path: Path, metadata: dict[str, Any], key: str, kind: str, default: Any = _MISSING) -> Any:
    """metadata[key] if it has the expected kind ("int", "number", "str", "bool"); else ModelLoadError naming it."""
    if key not in metadata:
        if default is _MISSING:
            raise ModelLoadError(f"{path}: metadata key {key} is missing ({_KINDS[kind]} expected)")
        return default
    value = metadata[key]
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str), "bool": isinstance(value, bool)}[kind]
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise ModelLoadError(f"{path}: metadata key {key} is {type(value).__name__} {shown}, expected {_KINDS[kind]}")
    if kind == "number" and not math.isfinite(value):  # inf passed every `> 0` check downstream
        raise ModelLoadError(f"{path}: metadata key {key} is {value!r}, expected a finite number")
    return value


def config_from_metadata(path: Path, metadata: dict[str, Any], reader: Any, float32: bool = True) -> ModelConfig:
    arch = metadata_value(path, metadata, "general.architecture", "str")
    architecture = architecture_of(path, arch)

    read: set[str] = set()  # the `<arch>.` keys asked for: any other is refused (metadata_keys.py)

    def value(key: str, kind: str = "int", default: Any = _MISSING) -> Any:
        read.add(key)
        return metadata_value(path, metadata, f"{arch}.{key}", kind, default)

    rope_scale = linear_factor(path, arch, value)

    d_model = value("embedding_length")
    n_heads = value("attention.head_count")
    head_dim = value("attention.key_length", default=d_model // max(n_heads, 1))
    rope_dims = value("rope.dimension_count", default=head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    vocab = value("vocab_size", default=None) or _vocab_from_embedding(path, reader)
    eos_ids = tuple(dict.fromkeys(
        metadata_value(path, metadata, key, "int") for key in ("tokenizer.ggml.eos_token_id",
                                                              "tokenizer.ggml.eot_token_id") if key in metadata
    ))
    bos = metadata_value(path, metadata, "tokenizer.ggml.bos_token_id", "int", None)
    shape = {"n_layers": value("block_count"), "d_model": d_model, "n_heads": n_heads, "head_dim": head_dim,
             "rope_base": float(value("rope.freq_base", "number", 10000.0)), "rope_scale": rope_scale}
    try:
        config = ModelConfig(
            name=path.stem,
            n_layers=shape["n_layers"],
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=value("attention.head_count_kv", default=n_heads),
            head_dim=head_dim,
            d_ff=value("feed_forward_length"),
            vocab_size=vocab,
            rope_base=shape["rope_base"],
            rms_eps=float(value("attention.layer_norm_rms_epsilon", "number", 1e-5)),
            context_length=value("context_length"),
            bos_id=bos,
            eos_ids=eos_ids,
            architecture=arch,
            rope_factors=_rope_factors(path, reader, head_dim),
            rope_scale=rope_scale,
            **architecture.settings(value, shape),
        )
    except (ModelConfigError, ValueError) as exc:
        raise _naming_the_file(path, exc, "inconsistent metadata: ") from exc
    check_every_key_honoured(path, arch, metadata, read, head_dim)
    need = config.weight_bytes() if float32 else sum(int(t.n_bytes) for t in reader.tensors)
    if not fits(need):
        raise ModelLoadError(f"{path}: its weights need {gib(need)}{' as float32' if float32 else ''}, more than "
                             f"the memory available now ({gib(available_bytes() or 0)})")
    return config


def _rope_factors(path: Path, reader: Any, head_dim: int) -> tuple[float, ...]:
    """The rope_freqs tensor (each RoPE frequency's divisor, llama.cpp's form of Llama 3's rope scaling), or ()."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return ()
    factors = tensor_as_float32(path, tensor, (head_dim // 2,))
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ModelLoadError(f"{path}: tensor {ROPE_FREQS} must hold positive finite numbers")
    return tuple(float(f) for f in factors)


def _naming_the_file(path: Path, error: Exception, what: str = "") -> ModelLoadError:
    """error as a ModelLoadError that names the file once (a metadata check inside already names it)."""
    text = str(error)
    return ModelLoadError(text if text.startswith(f"{path}: ") else f"{path}: {what}{text}")


def _vocab_from_embedding(path: Path, reader: Any) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            if len(tensor.shape) != 2:  # its last dim was taken for the vocabulary: "bos_id ... below 1"
                raise ModelLoadError(f"{path}: tensor token_embd.weight has {len(tensor.shape)} dimensions "
                                     f"{tensor.shape.tolist()}; an embedding has 2 (d_model, vocabulary)")
            return int(tensor.shape[-1])
    raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")


def weights_from_tensors(path: Path, config: ModelConfig, tensors: dict[str, Any]) -> DecoderWeights:
    """Dequantise and lay out every weight. Two threads: NumPy releases the GIL in the bulk work."""
    expected = check_tensor_names(path, config, tensors)

    def dense(name: str) -> np.ndarray:
        return tensor_as_float32(path, tensors[name], expected[name])

    optional = {argument: name for field, parts in OPTIONAL_LAYER_TENSORS.items() if getattr(config.layout, field)
                for argument, name in parts.items()}

    def layer(index: int):
        return layer_from_gguf_matrices(*(dense(f"blk.{index}.{part}.weight") for part in LAYER_TENSORS),
                                        **{arg: dense(f"blk.{index}.{name}") for arg, name in optional.items()})

    def owned(name: str) -> np.ndarray:  # an F32 tensor comes back as a view of the file mapping
        array = dense(name)
        return array.copy() if np.may_share_memory(array, tensors[name].data) else array

    def output() -> tuple[np.ndarray, np.ndarray]:
        embedding = owned("token_embd.weight")
        if "output.weight" not in tensors:
            return embedding, embedding.T  # tied: one copy, output-major as the other matrices
        return embedding, owned("output.weight").T

    with ThreadPoolExecutor(max_workers=2) as pool:
        output_job = pool.submit(output)
        layers = tuple(pool.map(layer, range(config.n_layers)))
        embedding, output_t = output_job.result()
    return DecoderWeights(embedding, layers, dense("output_norm.weight").copy(), output_t)


def check_tensor_names(path: Path, config: ModelConfig, tensors: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, with its shape; ModelLoadError naming a missing or an unexpected one."""
    expected = _expected_shapes(config, tied="output.weight" not in tensors,
                                rope_freqs=ROPE_FREQS in tensors)  # n_layers is bounded: small
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{path}: unexpected tensor {unexpected[0]} for a {config.architecture} model (ignoring it would "
            f"compute something other than what the file describes)"
        )
    for name, shape in expected.items():
        check_tensor(path, tensors[name], shape)
    return expected


def _expected_shapes(config: ModelConfig, tied: bool, rope_freqs: bool) -> dict[str, tuple[int, ...]]:
    d, q, kv, ff, hd = config.d_model, config.q_dim, config.kv_dim, config.d_ff, config.head_dim
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    if not tied:
        shapes["output.weight"] = (config.vocab_size, d)
    if rope_freqs:
        shapes[ROPE_FREQS] = (hd // 2,)
    per_layer = {f"{part}.weight": shape for part, shape in (
        ("attn_norm", (d,)), ("attn_q", (q, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, q)),
        ("ffn_norm", (d,)), ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff)))}
    optional = {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_q_norm.weight": (hd,),
                "attn_k_norm.weight": (hd,), "post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)}
    for field, parts in OPTIONAL_LAYER_TENSORS.items():
        if getattr(config.layout, field):
            per_layer.update({name: optional[name] for name in parts.values()})
    for index in range(config.n_layers):
        shapes.update({f"blk.{index}.{part}": shape for part, shape in per_layer.items()})
    return shapes


def tokenizer_from_reader(path: Path, reader: Any, metadata: dict[str, Any], vocab_size: int) -> GGUFTokenizer:
    """The file's own tokenizer (byte-level BPE or SentencePiece BPE) and chat template; ModelLoadError naming the
    key if it is missing or unusable."""
    kind = metadata_value(path, metadata, "tokenizer.ggml.model", "str", None)
    if kind is None:
        raise ModelLoadError(f"{path}: metadata key tokenizer.ggml.model is missing: pagevis needs the model's own "
                             "tokenizer (byte-level BPE 'gpt2' or SentencePiece 'llama') in the file")
    if kind not in TOKENIZER_KINDS:
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported; pagevis reads byte-level BPE "
                             "('gpt2') and SentencePiece BPE with byte fallback ('llama')")

    def array(key: str, item: type) -> Any:
        """key's values, each an item (numbers may come as one ndarray), or None when the file has no key."""
        if key not in reader.fields:
            return None
        values = field_values(reader, key)
        if isinstance(values, np.ndarray):  # numbers read in one view: integers if their type is one
            ok = item is int and values.dtype.kind in "iu"
        elif reader.fields[key].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]:  # every item decoded as a str
            ok = item is str
        else:
            ok = isinstance(values, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in values)
        if not ok:
            raise ModelLoadError(f"{path}: metadata key {key} must be a list of {item.__name__} values")
        return values

    tokens: list[str] | None = array("tokenizer.ggml.tokens", str)
    if tokens is None:
        raise ModelLoadError(f"{path}: metadata key tokenizer.ggml.tokens is missing")
    if len(tokens) != vocab_size:
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} tokens; the model's vocabulary "
                             f"has {vocab_size}")
    token_types: list[int] | np.ndarray | None = array("tokenizer.ggml.token_type", int)
    token_types = np.ones(len(tokens), np.int32) if token_types is None or not len(token_types) else token_types
    if len(token_types) != len(tokens):
        raise ModelLoadError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                             f"{len(tokens)} tokens")

    def value(key: str, kind_: str, default: Any) -> Any:
        return metadata_value(path, metadata, f"tokenizer.{key}", kind_, default)

    backend: Tokenizer | Callable[[], Tokenizer]
    try:
        if kind == "gpt2":
            _check_byte_tokens(path, tokens)
            merges: list[str] = array("tokenizer.ggml.merges", str) or []  # a byte-only vocabulary needs none
            backend = byte_level_backend(tokens, merges, token_types, value("ggml.pre", "str", "default"))
            add_bos_default = False
        else:
            space_prefix = value("ggml.add_space_prefix", "bool", True)
            check_spellable(tokens, token_types)  # before the (cached) build: a cached file is checked too
            cached = functools.partial(cached_merges, path, len(tokens))
            # built by GGUFTokenizer once it has read the tokens, which the build then takes over (and empties)
            backend = functools.partial(sentencepiece_backend, tokens, token_types, space_prefix, cached)
            add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary that does not say
        return GGUFTokenizer(
            backend, kind, tokens, token_types,
            bos_id=value("ggml.bos_token_id", "int", None), eos_id=value("ggml.eos_token_id", "int", None),
            add_bos=value("ggml.add_bos_token", "bool", add_bos_default),
            chat_template=value("chat_template", "str", None))
    except ValueError as exc:  # ModelLoadError (a bad template) is one
        raise _naming_the_file(path, exc) from exc
    except BaseException as exc:  # the tokenizers library refusing the vocabulary: its own exception type, or a Rust
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # panic (pyo3's PanicException is a
            raise                                                              # BaseException)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: the tokenizer cannot be built from this vocabulary: {reason}") from None


def _check_byte_tokens(path: Path, tokens: list[str]) -> None:
    spelled, known = byte_to_unicode(), set(tokens)
    missing = sorted(spelled[b] for b in REQUIRED_BYTES if spelled[b] not in known)
    if missing:
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens lacks {len(missing)} byte tokens of printable ASCII, "
                             f"tab and newline (e.g. {missing[0]!r}); pagevis needs a byte-level BPE vocabulary")

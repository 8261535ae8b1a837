"""Shared fixtures and helpers for the model tests (the real model loads once per session)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

REFERENCE_FILE = Path(__file__).parent / "data" / "smollm2_reference.json"


@lru_cache(maxsize=1)
def _load_smollm2():
    from pagevis.model import load_model, set_blas_threads

    # Two spinning OpenBLAS threads make decoding 5-10x slower when the other core is busy, as it
    # is on a shared CI machine (see docs/model.md); one thread costs ~15% when idle.
    set_blas_threads(1)
    return load_model()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct. Each test module that imports this fixture gets its own fixture
    definition, so the model itself is cached here to load once per session."""
    return _load_smollm2()


@pytest.fixture(scope="session")
def reference() -> dict:
    """Known answers frozen by scripts/make_reference_vectors.py (transformers + tokenizers)."""
    return json.loads(REFERENCE_FILE.read_text())


def write_llama_gguf(path: Path, model=None, arch: str = "llama", tensor_overrides: dict | None = None,
                     drop_tensors: tuple[str, ...] = (), tokenizer: bool = True,
                     metadata_overrides: dict | None = None, byte_tokens: bool = True,
                     sentencepiece: list[str] | None = None, spm_bytes: range | tuple = range(256),
                     spm_unknown: bool = True) -> Path:
    """Write a small Llama-layout GGUF (F32) holding model's weights (a SyntheticModel by default).

    metadata_overrides replaces metadata values (str, int or float); byte_tokens=False spells the 256
    byte tokens as <byteN> words instead, a vocabulary that cannot encode arbitrary text. sentencepiece: a
    SentencePiece ("llama") vocabulary instead: <pad> <eos> <bos> <unk>, the 256 <0xNN> byte tokens, then these
    pieces (model.config.vocab_size must be their count); spm_bytes: which byte tokens it has, spm_unknown: whether
    it has <unk>."""
    import gguf

    from pagevis.model.synthetic import SyntheticModel

    model = model or SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, seed=3)
    c, w = model.config, model.weights
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    if sentencepiece is not None:
        writer.add_tokenizer_model("llama")
        unknown = ["<unk>"] if spm_unknown else []
        writer.add_token_list(["<pad>", "<eos>", "<bos>", *unknown, *(f"<0x{b:02X}>" for b in spm_bytes), *sentencepiece])
        writer.add_token_types([3, 3, 3] + [2] * len(unknown) + [6] * len(spm_bytes) + [1] * len(sentencepiece))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    elif tokenizer:
        from pagevis.model.vocab_tokenizer import byte_to_unicode

        writer.add_tokenizer_model("gpt2")
        writer.add_string("tokenizer.ggml.pre", "smollm")
        spelled = byte_to_unicode()
        bytes_ = [spelled[b] if byte_tokens else f"<byte{b}>" for b in range(256)]
        writer.add_token_list(bytes_ + [f"<extra{i}>" for i in range(c.vocab_size - 256)])
        writer.add_token_merges([])
    for key, value in (metadata_overrides or {}).items():
        kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.FLOAT32
                if isinstance(value, float) else gguf.GGUFValueType.UINT32)
        writer.add_key_value(key, value, kind)
    q, kv = c.q_dim, c.kv_dim
    tensors = {"token_embd.weight": np.ascontiguousarray(w.embedding), "output_norm.weight": w.output_norm}
    for i, layer in enumerate(w.layers):
        wqkv = layer.wqkv.T  # back to (out, in)
        gate_up = layer.w_gate_up.T
        tensors.update({
            f"blk.{i}.attn_norm.weight": layer.attn_norm,
            f"blk.{i}.attn_q.weight": wqkv[:q], f"blk.{i}.attn_k.weight": wqkv[q:q + kv],
            f"blk.{i}.attn_v.weight": wqkv[q + kv:], f"blk.{i}.attn_output.weight": layer.wo.T,
            f"blk.{i}.ffn_norm.weight": layer.ffn_norm,
            f"blk.{i}.ffn_gate.weight": gate_up[:c.d_ff], f"blk.{i}.ffn_up.weight": gate_up[c.d_ff:],
            f"blk.{i}.ffn_down.weight": layer.w_down.T,
        })
    tensors.update(tensor_overrides or {})
    for name, array in tensors.items():
        if name not in drop_tensors:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

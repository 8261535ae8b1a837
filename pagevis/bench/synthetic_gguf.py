"""A Q4_K_M GGUF of Llama 3.2 1B's shapes with random weights, written with gguf-py for the weights bench.

Random blocks measure speed and memory, not text. The types follow llama.cpp's Q4_K_M for this model: Q4_K
for most matrices, Q6_K for the tied embedding and for attn_v and ffn_down of every other layer, F32 norms.
The vocabulary is the 256 byte-level symbols, one merge and filler tokens: a tokenizer both loaders accept.
Tensors are streamed to the file one at a time (the largest, the embedding, is ~215 MB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LLAMA_32_1B = dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192, vocab=128256)


def write_q4_k_m_gguf(path: Path, shape: dict = LLAMA_32_1B, seed: int = 0) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    from pagevis.model.quantized import FORMATS
    from pagevis.model.vocab_tokenizer import byte_to_unicode

    rng = np.random.default_rng(seed)
    s = dict(shape)
    d, ff, vocab = s["d_model"], s["d_ff"], s["vocab"]
    q_dim, kv_dim = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]
    tensors: list[tuple[str, tuple[int, int] | tuple[int], Q]] = [("token_embd.weight", (vocab, d), Q.Q6_K),
                                                                  ("output_norm.weight", (d,), Q.F32)]
    for i in range(s["n_layers"]):
        more_bits = Q.Q6_K if i % 2 == 0 else Q.Q4_K
        tensors += [(f"blk.{i}.attn_norm.weight", (d,), Q.F32), (f"blk.{i}.ffn_norm.weight", (d,), Q.F32),
                    (f"blk.{i}.attn_q.weight", (q_dim, d), Q.Q4_K), (f"blk.{i}.attn_k.weight", (kv_dim, d), Q.Q4_K),
                    (f"blk.{i}.attn_v.weight", (kv_dim, d), more_bits),
                    (f"blk.{i}.attn_output.weight", (d, q_dim), Q.Q4_K),
                    (f"blk.{i}.ffn_gate.weight", (ff, d), Q.Q4_K), (f"blk.{i}.ffn_up.weight", (ff, d), Q.Q4_K),
                    (f"blk.{i}.ffn_down.weight", (d, ff), more_bits)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("synthetic Llama 3.2 1B shapes, Q4_K_M, random weights")
    writer.add_block_count(s["n_layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    symbols = list(byte_to_unicode().values())
    writer.add_token_list(symbols + ["ab"] + [f"<t{i}>" for i in range(vocab - len(symbols) - 1)])
    writer.add_token_merges(["a b"])  # llama.cpp refuses a byte-level BPE vocabulary without merges
    writer.add_token_types([1] * vocab)
    writer.add_eos_token_id(vocab - 1)

    def raw(kind: Q, rows: int, n_in: int) -> np.ndarray:
        _, _, block_bytes, block_weights = FORMATS[kind]
        blocks = rng.integers(0, 256, (rows * (n_in // block_weights), block_bytes), dtype=np.uint8)
        for at in ((0, 2) if kind == Q.Q4_K else (208,)):  # sane float16 scales (Q4_K: d, dmin; Q6_K: d)
            blocks[:, at:at + 2] = np.array([0.002 if at == 208 else 0.01], np.float16).view(np.uint8)[None]
        return blocks.reshape(rows, -1)

    for name, tensor_shape, kind in tensors:
        if kind == Q.F32:
            writer.add_tensor_info(name, tensor_shape, np.dtype(np.float32), 4 * tensor_shape[0])
        else:
            _, _, block_bytes, block_weights = FORMATS[kind]
            byte_shape = (tensor_shape[0], tensor_shape[1] // block_weights * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, tensor_shape, kind in tensors:
        if kind == Q.F32:
            writer.write_tensor_data(np.ones(tensor_shape, np.float32))
        else:
            writer.write_tensor_data(raw(kind, *tensor_shape))
    writer.close()
    return path

"""Tiny random-weight Llama GGUFs whose metadata asks for linear RoPE scaling in each way llama.cpp reads it, and
transformers' logits for them.

Writes tests/data/rope-scaling/*.gguf (F32, 55-80 KB each) with gguf.GGUFWriter and
tests/data/rope-scaling/reference.json: for each file, transformers' logits (float32, its own GGUF loader, eager
attention) at five positions of a fixed id sequence. transformers' GGUF loader does not read RoPE scaling keys, so its config is
given the scaling llama.cpp reads from each file (pagevis/model/rope_scaling.py):

- factor-no-type: llama.rope.scaling.factor 8, no scaling type (llama.cpp: linear)   -> linear, factor 8
- scale-linear:   the older llama.rope.scale_linear 4                                 -> linear, factor 4
- linear-type:    llama.rope.scaling.type "linear", factor 2                          -> linear, factor 2
- none-type:      llama.rope.scaling.type "none", factor 8 (llama.cpp never scales)   -> no scaling
- gemma3-linear:  a 6-layer Gemma 3 (layers 0-4 local, window 4, base 10 000; layer 5 global, base 10**6) with
                  gemma3.rope.scaling.type "linear", factor 8: only the global layer is scaled, in llama.cpp
                  (rope_freq_scale_train_swa = 1) as in transformers (rope_parameters["full_attention"])

    python3.11 -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 transformers gguf numpy
    /work/torchvenv/bin/python scripts/make_rope_scaling_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "rope-scaling"
D, HEADS, KV, HEAD_DIM, FF, LAYERS, BASE, VOCAB = 16, 2, 1, 8, 32, 2, 10000.0, 256
IDS = [int(i) for i in np.random.default_rng(11).integers(0, VOCAB, 32)]
ROWS = [1, 9, 17, 25, 31]  # the positions whose logits are kept (position 0 turns by no angle at all)
# name -> (metadata written, the scaling transformers is told: None or ("linear", factor))
CASES = {
    "factor-no-type": ({"llama.rope.scaling.factor": 8.0}, ("linear", 8.0)),
    "scale-linear": ({"llama.rope.scale_linear": 4.0}, ("linear", 4.0)),
    "linear-type": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, ("linear", 2.0)),
    "none-type": ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 8.0}, None),
    "gemma3-linear": ({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}, ("linear", 8.0)),
}
GEMMA_LAYERS, GEMMA_WINDOW, GEMMA_BASE, LOCAL_BASE = 6, 4, 1e6, 10000.0


def byte_tokens() -> list[str]:
    """GPT-2's byte alphabet (pagevis's loader wants a byte-level vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    spelled = dict(zip(printable, chars))
    return [chr(spelled[b]) for b in range(256)]


def write(name: str, metadata: dict, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    m = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
    v = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    path = OUT / f"{name}.gguf"
    gemma = name.startswith("gemma3")
    layers = GEMMA_LAYERS if gemma else LAYERS
    writer = gguf.GGUFWriter(str(path), "gemma3" if gemma else "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(GEMMA_BASE if gemma else BASE)
    writer.add_layer_norm_rms_eps(1e-5)
    if gemma:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(GEMMA_WINDOW)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_tokens())
    writer.add_token_merges([])
    for key, value in metadata.items():
        kind = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.FLOAT32
        writer.add_key_value(key, value, kind)
    embedding = rng.standard_normal((VOCAB, D)) / (np.sqrt(D) if gemma else 1)  # (Gemma scales it by sqrt(D))
    tensors = {"token_embd.weight": embedding.astype(np.float32),
               "output_norm.weight": v(D)}
    if not gemma:  # Gemma ties its output to the embedding
        tensors["output.weight"] = m(VOCAB, D) * 3
    for i in range(layers):
        block = {"attn_norm.weight": v(D), "attn_q.weight": m(HEADS * HEAD_DIM, D) * 3,
                 "attn_k.weight": m(KV * HEAD_DIM, D) * 3, "attn_v.weight": m(KV * HEAD_DIM, D),
                 "attn_output.weight": m(D, HEADS * HEAD_DIM), "ffn_norm.weight": v(D),
                 "ffn_gate.weight": m(FF, D), "ffn_up.weight": m(FF, D), "ffn_down.weight": m(D, FF)}
        if gemma:  # (norms as llama.cpp stores Gemma's: the 1 + w already added)
            block.update({"attn_q_norm.weight": v(HEAD_DIM), "attn_k_norm.weight": v(HEAD_DIM),
                          "post_attention_norm.weight": v(D), "post_ffw_norm.weight": v(D)})
        tensors.update({f"blk.{i}.{part}": array for part, array in block.items()})
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference(path: Path, scaling: tuple[str, float] | None) -> list[list[float]]:
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.name.startswith("gemma3"):
        config.query_pre_attn_scalar = HEAD_DIM  # llama.cpp's (and Gemma 3's but the 27B): 1/sqrt(head_dim)
        config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_BASE},
                                  "full_attention": {"rope_type": scaling[0], "factor": scaling[1],
                                                     "rope_theta": GEMMA_BASE}}
    else:
        config.rope_parameters = {"rope_type": "default", "rope_theta": BASE} if scaling is None else {
            "rope_type": scaling[0], "factor": scaling[1], "rope_theta": BASE}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0].numpy()
    return np.round(logits[ROWS], 5).tolist()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {}
    for name, (metadata, scaling) in CASES.items():
        path = write(name, metadata, seed=0)  # the same weights in every file: only the scaling differs
        cases[name] = {"file": path.name, "scaling": scaling, "logits": reference(path, scaling)}
        print(name, path.stat().st_size, "bytes", flush=True)
    (OUT / "reference.json").write_text(json.dumps(
        {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "ids": IDS, "rows": ROWS,
         "cases": cases}) + "\n")


if __name__ == "__main__":
    main()

"""Tiny random-weight GGUFs of the Qwen 2, Qwen 3 and Llama 3 layouts, and transformers' answers for them.

Writes tests/data/tiny-{qwen2,qwen3,llama3}.gguf (F32, ~100 KB each) with gguf.GGUFWriter and
tests/data/tiny_models_reference.json: for each file, transformers' logits (float32, its own GGUF loader) for a
fixed id sequence, and its tokenizer's ids for a hard string set. Each file has a real byte-level BPE vocabulary
(256 bytes + merges trained here on a short text + control tokens) and the file's pre-tokenizer (qwen2,
llama-bpe). The Llama 3 file carries rope_freqs computed by llama.cpp's rule for rope_type llama3 with
original_max_position_embeddings 16 (so that the scaling changes the answer on a 40-token sequence); transformers
ignores that tensor, so its config is given the same llama3 rope parameters.

    /work/refvenv/bin/python scripts/make_tiny_model_reference.py   (torch, transformers, gguf, tokenizers)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TEXT = (ROOT / "resources" / "texts" / "pride-and-prejudice-ch1.txt").read_text()
HARD_STRINGS = ["Hello world", "  two spaces", "tabs\tand\nnew\n\nlines", "digits 1234567 3.14", "naïve café",
                "日本語 😀👍🏽", "<|im_start|>user\nhi<|im_end|>", "it's we'll THEY'RE", "x = f(y) + 2*z;"]
IDS = [int(i) for i in np.random.default_rng(7).integers(0, 200, 40)]
ROWS = [0, 7, 15, 23, 31, 39]  # the positions whose logits are kept (the file stays small)
SHAPES = {  # arch -> (n_embd, n_head, n_kv, head_dim, n_ff, n_layers, rope_base, pre-tokenizer)
    "qwen2": (32, 4, 2, 8, 64, 2, 1e6, "qwen2"),
    "qwen3": (32, 4, 2, 16, 64, 2, 1e6, "qwen2"),
    "llama3": (32, 4, 2, 8, 64, 2, 5e5, "llama-bpe"),
}
CONTROLS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def vocabulary() -> tuple[list[str], list[str]]:
    """256 byte tokens (GPT-2 alphabet), merges learned on TEXT, then the control tokens."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator([TEXT], trainer)
    state = json.loads(trained.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tokens + CONTROLS, merges


def llama3_factors(head_dim: int, base: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf rope_freqs for rope_type llama3."""
    s = LLAMA3_SCALING
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write(name: str, tokens: list[str], merges: list[str], seed: int) -> Path:
    d, heads, kv, hd, ff, layers, base, pre = SHAPES[name]
    arch = "llama" if name == "llama3" else name
    rng = np.random.default_rng(seed)
    m = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
    v = lambda n, mean=1.0: (mean + 0.2 * rng.standard_normal(n)).astype(np.float32)
    path = DATA / f"tiny-{name}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(CONTROLS)) + [3] * len(CONTROLS))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(name == "llama3")
    vocab = len(tokens)
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float32))
    writer.add_tensor("output_norm.weight", v(d))
    if name == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_factors(hd, base))
    else:
        writer.add_tensor("output.weight", m(vocab, d) * 3)
    for i in range(layers):
        block = {"attn_norm.weight": v(d), "attn_q.weight": m(heads * hd, d), "attn_k.weight": m(kv * hd, d),
                 "attn_v.weight": m(kv * hd, d), "attn_output.weight": m(d, heads * hd), "ffn_norm.weight": v(d),
                 "ffn_gate.weight": m(ff, d), "ffn_up.weight": m(ff, d), "ffn_down.weight": m(d, ff)}
        if name == "qwen2":
            block.update({"attn_q.bias": v(heads * hd, 0), "attn_k.bias": v(kv * hd, 0), "attn_v.bias": v(kv * hd, 0)})
        if name == "qwen3":
            block.update({"attn_q_norm.weight": v(hd), "attn_k_norm.weight": v(hd)})
        for part, array in block.items():
            writer.add_tensor(f"blk.{i}.{part}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference(name: str, path: Path) -> dict:
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.head_dim = SHAPES[name][3]  # transformers' GGUF mapping for qwen3 leaves head_dim at its default, 128
    if name == "llama3":
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": SHAPES[name][6], **LLAMA3_SCALING}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0].numpy()
    return {"file": path.name, "ids": IDS, "rows": ROWS, "logits": np.round(logits[ROWS], 5).tolist(),
            "strings": [{"text": t, "ids": tokenizer(t, split_special_tokens=True).input_ids} for t in HARD_STRINGS]}


def main() -> None:
    tokens, merges = vocabulary()
    out = {}
    for seed, name in enumerate(SHAPES):
        path = write(name, tokens, merges, seed)
        out[name] = reference(name, path)
        print(name, path.stat().st_size, "bytes", out[name]["strings"][0]["ids"], flush=True)
    (DATA / "tiny_models_reference.json").write_text(json.dumps(
        {"transformers": __import__("transformers").__version__, "models": out}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

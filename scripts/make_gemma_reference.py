"""Reference answers for Gemma 3 270M (tests/data/gemma3_reference.json), from transformers, not from pagevis.

Runs in a separate venv with torch and transformers (tests never need them):

    python3.11 -m venv /work/refvenv && /work/refvenv/bin/pip install torch==2.13.0 transformers gguf accelerate
    /work/refvenv/bin/python scripts/make_gemma_reference.py /path/to/gemma-3-270m-q4_k_m.gguf

The GGUF is the one `pagevis.model.locate.gemma3_270m_path()` assembles. transformers loads it with its own GGUF
loader (dequantised to float32) and tokenizer; decoding is greedy, eager attention (the exact sliding-window mask).
Recorded: the token ids of a hard string set (control-token text as text: split_special_tokens), and for each
prompt its ids, the greedy continuation and the top logits of the first step. The long prompt (over 900 tokens)
is only reproduced with a correct 512-token window on the local layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "gemma3_reference.json"
HARD_STRINGS = [
    "Hello world", "  two leading spaces", "trailing spaces   ", "tabs\tand\nnew\n\nlines\n\n\n",
    "digits 1234567890 3.14159 -42", "naïve café résumé Ölçü", "日本語のテキスト、中文文本。", "emoji 😀👍🏽 🇫🇷",
    "<start_of_turn>user\nhi<end_of_turn>", "<bos> <eos> <pad> <unk>", "<|im_start|>not gemma's<|im_end|>",
    "\u0000\u0001 control \u007f chars", "zero\u200bwidth", "mixed ünï 🙂 code: def f(x): return x**2",
]
SHORT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Übersetze: Der Hund läuft schnell. 日本"]
LONG_TOKENS = 1000
NEW_TOKENS = 12


def main(gguf: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    strings = [{"text": text, "ids": tokenizer(text, split_special_tokens=True).input_ids} for text in HARD_STRINGS]
    book = (ROOT / "resources" / "texts" / "pride-and-prejudice-ch1-6.txt").read_text()
    long_ids = tokenizer(book).input_ids[:LONG_TOKENS]
    prompts = [tokenizer(text).input_ids for text in SHORT_PROMPTS] + [long_ids]
    cases = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        top = torch.topk(logits, 5)
        cases.append({"ids": ids, "greedy": out[0, len(ids):].tolist(), "top_ids": top.indices.tolist(),
                      "top_logits": [round(v, 4) for v in top.values.tolist()]})
        print(len(ids), cases[-1]["greedy"], flush=True)
    OUT.write_text(json.dumps({"source": gguf.name, "transformers": __import__("transformers").__version__,
                               "long_prompt": "pride-and-prejudice-ch1-6.txt", "long_tokens": LONG_TOKENS,
                               "strings": strings, "prompts": cases}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

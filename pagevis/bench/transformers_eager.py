"""Decode speed of SmolLM2 in transformers (eager attention, torch CPU), for comparison with pagevis.

Runs as a script in any Python with torch, transformers, accelerate and gguf installed; it imports
nothing from pagevis, so `pagevis bench --transformers-python PATH` can run it in another environment
(torch is an optional extra of ours). Prints one JSON object: {"tokens_per_s", "threads", "versions"}.
Greedy decoding with transformers' own KV cache, one token per forward, after a warm-up.

    python pagevis/bench/transformers_eager.py --gguf PATH --tokens 64
"""

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import os

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    folder, name = os.path.split(os.path.abspath(args.gguf))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    prompt = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30]])
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)  # warm-up
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    generated = out.shape[1] - prompt.shape[1]
    print(json.dumps({"tokens_per_s": generated / elapsed, "tokens": generated,
                      "threads": torch.get_num_threads(),
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    main()

"""The tasks `pagevis eval` ships, as lm-eval task configs over local files (so it runs offline), and the
needle-in-a-haystack set it generates from a shipped text.

- `pagevis_mc`: 24 one-line general-knowledge questions, four choices each (resources/eval): accuracy.
- `pagevis_ppl`: chapter 1 of Pride and Prejudice (resources/texts), scored in lm-eval's rolling windows of
  --max-length tokens: word perplexity.
- `pagevis_needle`: a haystack of the novel's chapters 1-6 cut to each length (in the model's tokens), a
  sentence "The secret code is NNNN." placed at each depth (0 = the start, 1 = just before the question),
  then the question; the four choices are four codes, one of them the needle's: accuracy per depth and length.

Any other name is passed to lm-eval as it is: a task of its own registry, whose data the machine must have.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MC, PPL, NEEDLE = "pagevis_mc", "pagevis_ppl", "pagevis_needle"
SHIPPED = (MC, PPL, NEEDLE)
# The metric each shipped task reports in the table, and whether higher is better.
PRIMARY = {MC: ("acc", True), PPL: ("word_perplexity", False), NEEDLE: ("acc", True)}
QUESTION = "\n\nQuestion: What is the secret code in the text above?\nAnswer: The secret code is"
CHOICES = 4
MAX_NEEDLE_TOKENS = 1 << 14  # a haystack longer than the shipped text (about 10,100 SmolLM2 tokens) is refused


@dataclass(frozen=True)
class Needle:
    """The haystack grid: lengths in the model's tokens (the whole prompt, question included), depths in
    [0, 1], and samples per cell (each with other codes and another stretch of the text)."""

    lengths: tuple[int, ...] = (128, 256)
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    samples: int = 2
    seed: int = 0


def _resource(*parts: str) -> Path:
    return Path(str(resources.files("pagevis.resources").joinpath(*parts)))


def _json_task(name: str, path: Path, **config) -> dict:
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test", **config}


AGGREGATIONS = {"acc": "mean", "word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
                "bits_per_byte": "bits_per_byte"}  # lm-eval's names


def _metrics(*names: str) -> list[dict]:
    return [{"metric": name, "aggregation": AGGREGATIONS[name], "higher_is_better": name == "acc"} for name in names]


def task_config(name: str, folder: Path, tokenizer, needle: Needle) -> dict | str:
    """An lm-eval task config (a dict) for a shipped task, its data written under `folder`; other names as
    they are."""
    if name == MC:
        return _json_task(MC, _resource("eval", "multiple_choice.jsonl"), output_type="multiple_choice",
                          doc_to_text="{{question}}", doc_to_choice="{{choices}}", doc_to_target="{{answer}}",
                          metric_list=_metrics("acc"))
    if name == PPL:
        path = folder / "perplexity.jsonl"
        text = _resource("texts", "pride-and-prejudice-ch1.txt").read_text("utf-8")
        path.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
        return _json_task(PPL, path, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                          metric_list=_metrics("word_perplexity", "byte_perplexity", "bits_per_byte"))
    if name == NEEDLE:
        path = folder / "needle.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            for doc in needle_docs(tokenizer, needle):
                handle.write(json.dumps(doc) + "\n")
        return _json_task(NEEDLE, path, output_type="multiple_choice", doc_to_text="{{context}}",
                          doc_to_choice="{{choices}}", doc_to_target="{{answer}}", target_delimiter="",
                          metric_list=_metrics("acc"))
    return name


def needle_docs(tokenizer, needle: Needle) -> list[dict]:
    """One document per length x depth x sample: the haystack, the needle at its depth, the question."""
    words = _resource("texts", "pride-and-prejudice-ch1-6.txt").read_text("utf-8")
    hay = tokenizer.encode(words)
    rng = random.Random(needle.seed)
    docs = []
    for length in needle.lengths:
        for depth in needle.depths:
            for sample in range(needle.samples):
                codes = rng.sample(range(1000, 10000), CHOICES)
                sentence = f" The secret code is {codes[0]}. "
                room = length - len(tokenizer.encode(sentence + QUESTION))
                if room < 1 or room > len(hay):
                    raise ValueError(f"needle length {length}: between {length - room + 1} and "
                                     f"{len(hay) + length - room} tokens with this model and text")
                start = rng.randrange(0, len(hay) - room + 1)
                stretch = hay[start:start + room]
                cut = round(depth * room)
                context = tokenizer.decode(stretch[:cut]) + sentence + tokenizer.decode(stretch[cut:]) + QUESTION
                order = rng.sample(range(CHOICES), CHOICES)
                docs.append({"context": context, "choices": [f" {codes[i]}." for i in order],
                             "answer": order.index(0), "length": length, "depth": depth, "sample": sample})
    return docs

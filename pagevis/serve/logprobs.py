"""Log-probabilities in OpenAI's shapes, as vLLM answers them.

Completions (`logprobs: k`, with `echo` the prompt's tokens first): `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, one entry per token; a position's `top_logprobs` holds the token that came
there and the k most likely (so k or k + 1 entries), keyed by token text (by its printable label where two
tokens decode to one text, as stray bytes of a character do); the first prompt token has nothing
before it to be predicted from, so its log-probability and top entries are null. Chat (`logprobs: true`,
`top_logprobs: k`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
A row is (log-probability of the token, top ids, top log-probabilities), or None for the first prompt token.
Streamed, a chunk carries the rows of the tokens since the last chunk, offsets continuing (`start`).
"""

from __future__ import annotations

import math

import numpy as np

FLOOR = -9999.0  # vLLM's: a log-probability of -inf (a token masked out) is sent as this, JSON has no -inf

Row = tuple[float, list[int], list[float]] | None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def completion_logprobs(tokenizer, token_ids: list[int], rows: list[Row], start: int = 0) -> dict:
    """start: the first token's text offset (a streamed chunk's: the length of the tokens' text before it)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = start
    for token_id, row in zip(token_ids, rows, strict=True):
        text = tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if row is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen, top_ids, top = row
        token_logprobs.append(_finite(chosen))
        entries = {text: _finite(chosen)}
        for other, value in zip(top_ids, top, strict=True):
            if other == token_id:
                continue
            key = tokenizer.decode([other])
            # two tokens of one text (stray bytes of a character): the label keeps both entries apart
            entries[tokenizer.token_text(other) if key in entries else key] = _finite(value)
        top_logprobs.append(entries)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], rows: list[Row]) -> dict:
    def entry(token_id: int, value: float) -> dict:
        return {"token": tokenizer.decode([token_id]), "logprob": _finite(value),
                "bytes": list(tokenizer.token_bytes(token_id))}

    content = []
    for token_id, (chosen, top_ids, top) in zip(token_ids, rows, strict=True):
        item = entry(token_id, chosen)
        item["top_logprobs"] = [entry(other, value) for other, value in zip(top_ids, top, strict=True)]
        content.append(item)
    return {"content": content}


def prompt_rows(scores) -> list[Row]:
    """The rows of a prompt's tokens from the engine's Scores (row p scores token p + 1): None first."""
    return [None, *(scores.row(i) for i in range(len(scores.chosen)))]


def complete(scores) -> bool:
    """Whether every prompt token was scored (a request ended early leaves the rest unscored, NaN)."""
    return scores is not None and not np.isnan(scores.chosen).any()

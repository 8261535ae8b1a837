"""KVzip's reconstruction pass: score a sequence's cached prompt by how much re-reading it attends to it.

Kim et al. 2025, arXiv:2505.23416; the chunks and prompts of kvpress's `KVzipPress.prepare`. After the prompt
is prefilled, each chunk of `chunk` prompt tokens is fed as "\\n\\nRepeat the previous context exactly." (later
chunks: "... the part of the previous context exactly, starting with" and the previous chunk's last 8 tokens),
a newline (kvpress's suffix for a model without a chat template) and the chunk itself, at the positions after
the prompt. The forward is read-only: the model's `attend` is a `ReadOnlyAttend`, whose queries read the
cache and the chunk's own earlier tokens (causally) and which writes nothing, so every chunk sees the prompt's
cache alone, as kvpress's does (it drops each chunk's K/V after scoring). The cache hands each call's weights on
its tokens to the policy's statistics (`PolicyState.reconstruct`: kvzip's `ReconstructionScores`).

One difference: kvpress normalises a chunk's scores over its sinks, its own slice of the context and
itself; here they are the weights the pass pays over the whole cache. With one chunk (prompts up to
`chunk` tokens: every measurement in docs/policies.md) the two are the same.
"""

from __future__ import annotations

import time

import numpy as np

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
SUFFIX = "\n"
OVERLAP = 8  # tokens of the previous chunk that a later chunk's prompt repeats (kvpress's prev_postfix_size)


def reconstruction_chunks(tokenizer, context: list[int], chunk: int) -> list[np.ndarray]:
    """The token ids fed for each chunk of the context."""
    bos = len(tokenizer.encode(""))  # a tokenizer that starts every text with BOS: not inside the pass
    first, later, suffix = (tokenizer.encode(text)[bos:] for text in (FIRST_PROMPT, LATER_PROMPT, SUFFIX))
    pieces = [context[start: start + chunk] for start in range(0, len(context), chunk)]
    return [np.asarray([*(first if i == 0 else [*later, *pieces[i - 1][-OVERLAP:]]), *suffix, *piece],
                       dtype=np.int64) for i, piece in enumerate(pieces)]


class ReadOnlyAttend:
    """The `attend` of one reconstruction chunk: each layer's queries read the sequence's cache and the chunk's
    own tokens so far (the model may feed a chunk in pieces); its tokens are kept here, never in the cache."""

    def __init__(self, cache, seq_id: int):
        self.cache, self.seq_id = cache, seq_id
        self.own: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # layer -> the chunk's k, v, positions

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
        own_positions = positions
        if layer in self.own:
            old_k, old_v, old_positions = self.own[layer]
            k, v, own_positions = np.concatenate([old_k, k]), np.concatenate([old_v, v]), np.concatenate(
                [old_positions, positions])
        self.own[layer] = (k, v, own_positions)
        return self.cache.attend_beside(self.seq_id, layer, q, positions, k, v, own_positions).output


def reconstruct_and_compress(model, cache, seq_id: int) -> float:
    """Run the reconstruction pass over the sequence's cached tokens, then compress it (cache.compress);
    return the pass's seconds."""
    context = cache.token_ids(seq_id)
    chunks = reconstruction_chunks(model.tokenizer, context, cache.policy(seq_id).chunk)
    started = time.perf_counter()
    for ids in chunks:
        positions = np.arange(len(context), len(context) + len(ids), dtype=np.int64)
        model.forward(ids, positions, ReadOnlyAttend(cache, seq_id), logit_rows=np.array([len(ids) - 1]))
    seconds = time.perf_counter() - started
    fed = sum(len(ids) for ids in chunks)
    cache.compress(seq_id, fed, f"reconstruction pass: {fed} tokens in {len(chunks)} chunk"
                                f"{'s' if len(chunks) > 1 else ''}, {seconds:.2f} s")
    return seconds

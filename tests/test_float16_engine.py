"""An engine over float16 pages is, bit for bit, an engine over float32 pages whose K/V are rounded to float16 before
the cache sees them: every path (a prompt prefilled whole or in chunks, one request's decode, a batched decode among
others, an evicting policy's scores) attends over exactly the stored values, and nothing computes with the fresh
float32 K/V or in float16 arithmetic.

Why a float16 run drifts more than a float32 one between two ways of batching the same request (docs/serving.md):
the forward's float32 products depend on how many rows they multiply at once (matmul's plan picks a kernel per row
count) and the attention's sums on the chunk, so the fresh K/V of the same token differ by float32 rounding
(~1e-6); rounding them to float16 turns a few of those differences (~0.5% of the values) into a whole float16 step
(~1e-3 relative), which the next layers carry on. Measured (the synthetic model, "Client 3 asks about pages.", 16
tokens): its logprobs whole against chunks of 4 moved 4.6e-5 over float16 pages, 4.6e-5 over float32 pages fed
float16-rounded K/V (the same bits), 7e-7 over float32 pages. The runs below compare the same logprobs bit for bit,
so they compare the drifts too.

Would fail on: attention or a policy statistic over the fresh float32 K/V (a prefill chunk's own keys before they
are stored, a batched path's held tokens), a product or sum in float16 arithmetic, an inexact conversion."""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.engine import Engine, ModelSpec, SamplingConfig, SessionConfig
from pagevis.kvcache import EventKind

SYNTH = ModelSpec(kind="synthetic")


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _rounding_kv(monkeypatch, model):
    """The model (the loaded one is shared: until the test ends) with its forward's attend given K/V rounded to
    float16 (the same float32 dtype)."""
    forward = model.forward

    def rounded(ids, positions, attend, **kwargs):
        return forward(ids, positions, lambda layer, q, k, v, pos: attend(layer, q, _half(k), _half(v), pos), **kwargs)

    monkeypatch.setattr(model, "forward", rounded)
    return model


def _generated(model, dtype: str, chunk: int, companions: int, policy: str, max_pages: int):
    """Each request's generated tokens and their log-probabilities, and the cache's evictions (seq, layer,
    position, score)."""
    config = SessionConfig(page_size=4, max_pages=max_pages, policy=policy, dtype=dtype, max_new_tokens=12,
                           sampling=SamplingConfig(mode="greedy"))
    engine = Engine(model, config, max_chunk=chunk)
    prompts = [f"Client {i} asks about pages" + " and more" * i + "." for i in range(1 + companions)]  # (lengths
    # apart: a step holds one request's prefill chunk beside others' decoding rows)
    ids = [engine.submit(model.tokenizer.encode(prompt), scores=(0, None), ignore_eos=True) for prompt in prompts]
    requests = [engine.requests[i] for i in ids]
    evicted = []
    while not engine.done:
        record = engine.step()
        evicted += [(e.seq, e.layer, e.position, e.score) for e in record.events if e.kind is EventKind.EVICT]
    return ([(list(r.generated), [float(s.chosen[0]) for s in r.token_scores]) for r in requests], evicted)


@pytest.mark.parametrize(("chunk", "companions", "policy", "max_pages"), [
    (512, 0, "none", 16),  # the prompt in one chunk, then one request's decode (write_and_attend's kernel)
    (4, 0, "none", 16),  # in chunks of 4
    (4, 3, "none", 48),  # beside three others: prompts in one forward, a prefill beside decodes, batched decodes
    (4, 0, "h2o", 6),  # an evicting policy whose scores are the attention's weights
    (4, 3, "h2o", 8),  # ... among others in a pool they fill
])
def test_float16_pages_are_float32_pages_over_rounded_kv(monkeypatch, chunk, companions, policy, max_pages):
    half = _generated(SYNTH.load(), "float16", chunk, companions, policy, max_pages)
    rounded = _generated(_rounding_kv(monkeypatch, SYNTH.load()), "float32", chunk, companions, policy, max_pages)
    assert half == rounded
    assert (len(half[1]) > 0) == (policy == "h2o")


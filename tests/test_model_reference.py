"""SmolLM2 against known answers from an independent implementation (transformers on the same GGUF).

Tolerance for logits: both sides dequantise the same Q4_1/Q8_0 blocks to float32 and compute in
float32, so they differ only in summation order (BLAS blocking, threads, fused matrices here vs
separate ones there). Measured: at most 3e-5 absolute on logits of magnitude ~17. We allow 1e-3,
which leaves room for other BLAS builds yet is far below the gaps that decide greedy choices
(the smallest top-2 margin in the frozen greedy runs is 0.017).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagevis.model import DenseAttention

from model_fixtures import reference, smollm2  # noqa: F401  (fixtures)

LOGIT_ATOL = 1e-3
PROMPT_KINDS = ["plain-0", "plain-1", "chat"]


def _prompt(reference, label):
    plain = [p for p in reference["prompts"] if p["kind"] == "plain"]
    return reference["prompts"][-1] if label == "chat" else plain[int(label[-1])]


@pytest.fixture(scope="module")
def prefilled(smollm2, reference):
    """Per prompt: all-position logits of one prefill, and the attention holding it."""
    out = {}
    for label in PROMPT_KINDS:
        ids = _prompt(reference, label)["ids"]
        attention = DenseAttention(smollm2.config)
        logits = smollm2.forward(np.array(ids), np.arange(len(ids)), attention, all_logits=True)
        out[label] = (logits, attention)
    return out


@pytest.mark.parametrize("label", PROMPT_KINDS)
def test_top_logits_match_reference(prefilled, reference, label):
    expected = _prompt(reference, label)
    last = prefilled[label][0][-1]
    assert last.dtype == np.float32
    assert np.argsort(-last, kind="stable")[:3].tolist() == expected["top_ids"][:3]
    np.testing.assert_allclose(last[expected["top_ids"]], expected["top_logits"], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("label", PROMPT_KINDS)
def test_argmax_at_every_prompt_position_matches(prefilled, reference, label):
    assert prefilled[label][0].argmax(-1).tolist() == _prompt(reference, label)["argmax_per_position"]


@pytest.mark.parametrize("label", ["plain-0", "chat"])
def test_greedy_continuation_matches(smollm2, prefilled, reference, label):
    expected = _prompt(reference, label)
    logits, attention = prefilled[label]
    position, token = len(expected["ids"]), int(logits[-1].argmax())
    generated = []
    for _ in range(len(expected["greedy_ids"])):
        generated.append(token)
        token = int(smollm2.forward(np.array([token]), np.array([position]), attention).argmax())
        position += 1
    assert generated == expected["greedy_ids"]


def test_chat_prompt_text_matches_reference_template(smollm2, reference):
    chat = _prompt(reference, "chat")
    messages = [{"role": "user", "content": chat["user_message"]}]
    assert smollm2.tokenizer.format_chat(messages) == chat["text"]
    assert smollm2.tokenizer.chat_system_prompt == reference["system_prompt"]


def test_prefill_at_once_equals_token_by_token(smollm2, prefilled, reference):
    ids = _prompt(reference, "plain-0")["ids"]
    attention = DenseAttention(smollm2.config)
    stepwise = np.stack([smollm2.forward(np.array([t]), np.array([p]), attention) for p, t in enumerate(ids)])
    np.testing.assert_allclose(stepwise, prefilled["plain-0"][0], rtol=0, atol=LOGIT_ATOL)

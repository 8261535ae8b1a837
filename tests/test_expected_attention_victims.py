"""Expected attention's scoring, made cheap (a product and a row sum for kᵀΣk instead of a three-operand
einsum), evicts what the einsum did: at every victim choice of a real SmolLM2 run whose prompt overflows a
16 x 16 cache, the score as it was computed before (below, unchanged) picks the same token."""

import numpy as np
import pytest

from pagevis.engine import DecodeSession, SessionConfig
from pagevis.kvcache.policies import base
from pagevis.kvcache.policies.expected_attention import ExpectedAttention
from tests.model_fixtures import smollm2  # noqa: F401 (a fixture)

PROMPT = "resources/texts/pride-and-prejudice-ch1.txt"


def einsum_scores(policy, pages):
    """The token score as ExpectedAttention computed it before it was made cheap (kᵀΣk by einsum), one query
    head at a time: softmax over its KV head's candidates, times ||v||, averaged over the group, then over KV
    heads; sinks above every other token."""
    state = pages.stats
    n_kv, d = state.keys.shape[1:]
    mean, cov = state.moments()
    rotation = policy._mean_rotation(state)
    group = len(mean) // n_kv
    sinks = pages.occupied() & (pages.positions < policy.n_sink)
    per_head = np.zeros((len(mean), len(pages.positions)))
    for h in range(len(mean)):
        kv = h // group
        rows = np.flatnonzero(np.broadcast_to(pages.kept(), (n_kv, len(sinks)))[kv] & ~sinks)
        keys = state.keys[rows, kv].astype(np.float64)
        logits = keys @ (rotation @ mean[h]) / np.sqrt(d)
        if policy.use_covariance:
            logits += np.einsum("ti,ij,tj->t", keys, rotation @ cov[h] @ rotation.T, keys) / (2 * d)
        weights = np.exp(logits - logits.max())
        per_head[h, rows] = weights / weights.sum() * (state.value_norms[rows, kv] if policy.use_vnorm else 1)
    scores = per_head.reshape(n_kv, group, -1).mean(axis=1)
    scores[:, sinks] = scores.max() + 1
    return scores.mean(axis=0)


@pytest.mark.slow
def test_victims_are_the_einsum_scores_victims(smollm2, monkeypatch):  # noqa: F811
    choices = []
    original = base.EvictionPolicy.choose_victims

    def checked(policy, pages):
        victims, scores = original(policy, pages)
        if isinstance(policy, ExpectedAttention):
            before = einsum_scores(policy, pages)
            np.testing.assert_allclose(policy.score(pages), before, rtol=1e-9, atol=0)
            candidates = pages.occupied() & ~policy.protected(pages)
            reference = np.where(candidates, before, np.inf)
            tied = np.flatnonzero(candidates & (reference == reference.min()))
            assert victims.tolist() == [tied[np.argmin(pages.positions[tied])]], f"layer {pages.layer}"
            choices.append(victims[0])
        return victims, scores

    monkeypatch.setattr(base.EvictionPolicy, "choose_victims", checked)
    ids = smollm2.tokenizer.encode(open(PROMPT).read())[:300]
    config = SessionConfig(page_size=16, max_pages=16, policy="expected-attention", max_new_tokens=2, chat=False,
                           record_layers=())
    session = DecodeSession(smollm2, "", config, prompt_ids=ids)
    session.record_cache = False
    for _ in session.run():
        pass
    assert len(choices) >= smollm2.config.n_layers * (300 - 256)

"""Expected attention's scoring, made cheap (Rᵀk by complex products, kᵀRΣRᵀk and k·Rμ from one float32 product
and a row sum, instead of a float64 three-operand einsum), evicts what the float64 einsum does, up to float32
rounding stated as a bound: at every victim choice of a real SmolLM2 run whose prompt overflows a 16 x 16 cache,
every candidate's score is within the bound of the reference's, and the victim is the reference's unless the
reference scores the two within the bound of each other (a near-tie float32 cannot order)."""

import numpy as np
import pytest

from pagevis.engine import DecodeSession, SessionConfig
from pagevis.kvcache.policies import base
from pagevis.kvcache.policies.expected_attention import ExpectedAttention
from tests.model_fixtures import smollm2  # noqa: F401 (a fixture)

PROMPT = "resources/texts/pride-and-prejudice-ch1.txt"
UNIT = 2.0 ** -24  # float32's unit roundoff


def einsum_scores(policy, pages):
    """The token score as ExpectedAttention computed it before it was made cheap (float64, kᵀΣk by einsum), one
    query head at a time: softmax over its KV head's candidates, times ||v||, averaged over the group, then over KV
    heads; sinks above every other token. Also the bound on the float32 logits' error: per query head, the largest
    over its candidates of γ (|Rᵀk|·|μ|/√d + |Rᵀk|ᵀ|Σ||Rᵀk|/(2d)), γ = (2d + 8) u — the d-term product and the d-term
    row sum (Higham's γ_d each) and the float32 roundings of Rᵀk, Σ and μ."""
    state = pages.stats
    n_kv, d = state.keys.shape[1:]
    mean, cov = state.moments()
    rotation = policy._mean_rotation(state)
    group = len(mean) // n_kv
    sinks = pages.occupied() & (pages.positions < policy.n_sink)
    per_head = np.zeros((len(mean), len(pages.positions)))
    error = 0.0
    for h in range(len(mean)):
        kv = h // group
        rows = np.flatnonzero(np.broadcast_to(pages.kept(), (n_kv, len(sinks)))[kv] & ~sinks)
        keys = state.keys[rows, kv].astype(np.float64)
        logits = keys @ (rotation @ mean[h]) / np.sqrt(d)
        if policy.use_covariance:
            logits += np.einsum("ti,ij,tj->t", keys, rotation @ cov[h] @ rotation.T, keys) / (2 * d)
        weights = np.exp(logits - logits.max())
        per_head[h, rows] = weights / weights.sum() * (state.value_norms[rows, kv] if policy.use_vnorm else 1)
        turned = np.abs(keys @ rotation)
        size = turned @ np.abs(mean[h]) / np.sqrt(d) + np.einsum("ti,ij,tj->t", turned, np.abs(cov[h]), turned) / (2 * d)
        error = max(error, (2 * d + 8) * UNIT * size.max())
    scores = per_head.reshape(n_kv, group, -1).mean(axis=1)
    scores[:, sinks] = scores.max() + 1
    return scores.mean(axis=0), error


@pytest.mark.slow
def test_victims_are_the_float64_scores_victims_up_to_float32_rounding(smollm2, monkeypatch):  # noqa: F811
    choices, differ = [], []
    original = base.EvictionPolicy.choose_victims

    def checked(policy, pages):
        victims, scores = original(policy, pages)
        if isinstance(policy, ExpectedAttention):
            before, error = einsum_scores(policy, pages)
            # logits off by at most `error` move each softmax weight by a factor within exp(±2 error)
            spread = np.expm1(2 * error) + 1e-12
            candidates = pages.occupied() & ~policy.protected(pages)
            np.testing.assert_array_less(np.abs(policy.score(pages) - before)[candidates],
                                         spread * before[candidates] + 1e-300)
            reference = np.where(candidates, before, np.inf)
            tied = np.flatnonzero(candidates & (reference == reference.min()))
            expected = tied[np.argmin(pages.positions[tied])]
            if victims[0] != expected:  # only where float32 cannot tell the two apart
                assert before[victims[0]] <= before[expected] * (1 + spread) ** 2, f"layer {pages.layer}"
                differ.append(before[victims[0]] / before[expected] - 1)
            choices.append(victims[0])
        return victims, scores

    monkeypatch.setattr(base.EvictionPolicy, "choose_victims", checked)
    ids = smollm2.tokenizer.encode(open(PROMPT).read())[:300]
    config = SessionConfig(page_size=16, max_pages=16, policy="expected-attention", max_new_tokens=2, chat=False,
                           record_layers=(), policy_params={"compress_every": 1})
    session = DecodeSession(smollm2, "", config, prompt_ids=ids)
    session.record_cache = False
    for _ in session.run():
        pass
    assert len(choices) >= smollm2.config.n_layers * (300 - 256)
    print(f"{len(differ)} of {len(choices)} victims differ from the float64 reference's, by relative scores {differ}")

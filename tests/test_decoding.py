"""Decoding sessions on the paged engine: equal to dense decoding when nothing is evicted, honest
records when things are, and an oracle whose numbers mean what they say."""

import numpy as np
import pytest

from pagevis.engine import DecodeSession, ModelSpec, SamplingConfig, SessionConfig, Sampler
from pagevis.kvcache import CacheFullError, ConfigError, EventKind
from pagevis.model import DenseAttention

SYNTH = ModelSpec(kind="synthetic", n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, seed=1)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def dense_greedy(model, prompt_ids, n_new):
    """Plain greedy decoding with a contiguous cache that keeps everything."""
    attention = DenseAttention(model.config)
    logits = model.forward(np.array(prompt_ids), np.arange(len(prompt_ids)), attention)
    out = []
    for i in range(n_new):
        token = int(np.argmax(logits))
        out.append(token)
        position = len(prompt_ids) + i
        logits = model.forward(np.array([token]), np.array([position]), attention)
    return out


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("dtype", ["float32"])
def test_no_eviction_equals_dense_decoding_token_for_token(page_size, dtype):
    model = SYNTH.load()
    session = DecodeSession(model, PROMPT, SessionConfig(page_size=page_size, max_pages=200, policy="none",
                                                         max_new_tokens=24, chat=False, dtype=dtype))
    list(session.run())
    assert session.generated == dense_greedy(model, list(session.prompt_ids), 24)
    assert session.records[0].kind == "prefill" and len(session.records[0].token_ids) == len(session.prompt_ids)
    assert session.stop_reason == "max_new_tokens"


@pytest.mark.slow
def test_smollm2_paged_equals_dense_and_answers():
    model = ModelSpec().load()
    session = DecodeSession(model, "What is the capital of France?",
                            SessionConfig(page_size=16, max_pages=8, policy="none", max_new_tokens=12))
    list(session.run())
    assert session.generated == dense_greedy(model, list(session.prompt_ids), len(session.generated))
    assert session.stop_reason == "eos" and session.text() == "The capital of France is Paris."


@pytest.mark.parametrize("policy", ["oldest", "oldest-page", "sinks", "h2o", "tova", "random"])
def test_bounded_records_agree_with_events_and_evicted_get_no_attention(policy):
    model = SYNTH.load()
    config = SessionConfig(page_size=4, max_pages=5, policy=policy, max_new_tokens=30, chat=False,
                           policy_params={"n_sink": 2} if policy == "sinks" else {})
    session = DecodeSession(model, PROMPT, config)
    resident = [set() for _ in range(model.config.n_layers)]
    for record in session.run():
        for event in record.events:
            if event.kind is EventKind.WRITE:
                resident[event.layer].add(event.position)
            elif event.kind is EventKind.EVICT:
                resident[event.layer].remove(event.position)
        n_positions = record.positions[-1] + 1
        for layer in range(model.config.n_layers):
            slots = record.slot_maps[layer]
            assert set(slots[slots >= 0].tolist()) == resident[layer]
            assert len(resident[layer]) <= 20
            assert list(record.block_tables[layer]) == [p for p in record.block_tables[layer]
                                                        if (slots[p] >= 0).any()]
            weights = record.attention_over_positions(layer, n_positions)
            gone = ~record.resident_mask(layer, n_positions)
            assert np.all(weights[:, gone] == 0), "an evicted token received attention"
            np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=2e-3)  # float16 storage
    assert record.evictions_total == sum(len(r.evictions) for r in session.records) > 0


def test_oracle_is_zero_without_eviction_and_positive_with_it():
    model = SYNTH.load()
    full = DecodeSession(model, PROMPT, SessionConfig(page_size=8, max_pages=64, max_new_tokens=10,
                                                      chat=False, oracle=True))
    for record in full.run():
        assert record.oracle.kl == pytest.approx(0, abs=1e-6)
        assert record.oracle.top1_agree
        assert record.oracle.lost_attention == 0
        assert record.oracle.logprob_bounded == pytest.approx(record.oracle.logprob_full, abs=1e-5)

    bounded = DecodeSession(model, PROMPT, SessionConfig(page_size=4, max_pages=3, policy="oldest",
                                                         max_new_tokens=10, chat=False, oracle=True))
    records = list(bounded.run())
    assert all(r.oracle is not None for r in records)
    late = records[-1].oracle
    assert late.kl > 1e-4 and 0 < late.lost_attention < 1


def test_oracle_lost_attention_matches_direct_computation():
    """Lost attention = the full cache's attention on positions the bounded cache no longer holds."""
    model = SYNTH.load()
    config = SessionConfig(page_size=4, max_pages=3, policy="sinks", policy_params={"n_sink": 2},
                           max_new_tokens=3, chat=False, oracle=True)
    session = DecodeSession(model, PROMPT, config)
    list(session.run())
    record = session.records[-1]
    # re-run the whole stream densely, capturing the last query's attention per layer
    captured = {}
    dense = DenseAttention(model.config)
    tokens = list(session.prompt_ids) + session.generated[:-1]

    def spy(layer, q, k, v, positions):
        out = dense(layer, q, k, v, positions)
        keys = dense._layers[layer].keys[: dense._layers[layer].length]
        kv = np.repeat(keys, model.config.n_heads // model.config.n_kv_heads, axis=1)
        scores = np.einsum("hd,thd->ht", q[-1].astype(np.float64), kv) / np.sqrt(model.config.head_dim)
        w = np.exp(scores - scores.max(1, keepdims=True))
        captured[layer] = w / w.sum(1, keepdims=True)
        return out

    model.forward(np.array(tokens), np.arange(len(tokens)), spy)
    n = len(tokens)
    lost = [captured[layer][:, ~record.resident_mask(layer, n)].sum(1).mean() for layer in range(model.config.n_layers)]
    assert record.oracle.lost_attention == pytest.approx(np.mean(lost), rel=1e-4)


def test_policy_none_full_cache_fails_cleanly_and_keeps_records():
    model = SYNTH.load()
    session = DecodeSession(model, "abcdefgh", SessionConfig(page_size=4, max_pages=3, policy="none",
                                                             max_new_tokens=20, chat=False))
    steps = []
    with pytest.raises(CacheFullError, match="policy 'none'"):
        while True:
            steps.append(session.step())
    assert len(session.records) == len(steps) and session.records[-1].resident_tokens == 12
    # nothing half-written: every layer holds the same 12 tokens
    for pages in session.cache.stores:
        assert sorted(pages.positions[pages.positions >= 0].tolist()) == list(range(12))


def test_long_prompt_is_evicted_during_prefill():
    model = SYNTH.load()
    session = DecodeSession(model, "x" * 50, SessionConfig(page_size=4, max_pages=4, policy="oldest",
                                                           max_new_tokens=2, chat=False))
    records = list(session.run())
    assert [len(r.token_ids) for r in records[:3]] == [16, 1, 1]
    assert records[1].evictions[0].position == 0
    assert sum(r.kind == "prefill" for r in records) == 50 - 16 + 1


class TestSampler:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))

    def test_greedy(self):
        assert Sampler(SamplingConfig()).sample(self.logits) == 0

    def test_top_k_and_top_p_cut_the_tail(self):
        probs = Sampler(SamplingConfig(mode="sample", temperature=1.0, top_k=2)).sample_probabilities(self.logits)
        np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
        probs = Sampler(SamplingConfig(mode="sample", temperature=1.0, top_p=0.85)).sample_probabilities(self.logits)
        np.testing.assert_allclose(probs, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])

    def test_temperature_and_seed(self):
        sampler = Sampler(SamplingConfig(mode="sample", temperature=1.0, seed=3))
        counts = np.bincount([sampler.sample(self.logits) for _ in range(4000)], minlength=4) / 4000
        np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)
        a = Sampler(SamplingConfig(mode="sample", seed=9))
        b = Sampler(SamplingConfig(mode="sample", seed=9))
        assert [a.sample(self.logits) for _ in range(50)] == [b.sample(self.logits) for _ in range(50)]
        cold = Sampler(SamplingConfig(mode="sample", temperature=0.05)).sample_probabilities(self.logits)
        assert cold[0] > 0.99

    @pytest.mark.parametrize("field,value", [("mode", "beam"), ("temperature", 0), ("top_k", -1),
                                             ("top_p", 1.5), ("seed", -1)])
    def test_bad_sampling_values(self, field, value):
        with pytest.raises(ConfigError, match=f"sampling.{field}"):
            SamplingConfig(**{field: value})


def test_bad_session_values():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SessionConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="record_layers"):
        DecodeSession(SYNTH.load(), "hi", SessionConfig(record_layers=(7,), chat=False))
    with pytest.raises(ConfigError, match="model"):
        ModelSpec(kind="gpt5")

"""Log-likelihood requests are prefill-bound: concurrent scored prompts prefill in one engine step, and
each one's scores are what it gets alone (a dense forward is the reference)."""

from __future__ import annotations

import numpy as np
from serve_fixtures import SYNTH

from pagevis.bench.prefill import format_prefill, prefill_row, run_prefill_bench
from pagevis.engine import Engine, SessionConfig
from pagevis.engine.batch import BatchConfig
from pagevis.engine.sampling import log_softmax
from pagevis.model import DenseAttention


def test_concurrent_scored_prompts_prefill_in_one_step_and_score_as_alone():
    model = SYNTH.load()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (20, 33, 7, 40)]
    engine = Engine(model, SessionConfig(page_size=8, max_pages=8, policy="none", max_new_tokens=1),
                    BatchConfig(max_seqs=4, token_budget=sum(map(len, prompts))))
    ids = [engine.submit(p, max_new_tokens=1, scores=(None, 2)) for p in prompts]
    first = engine.step()
    assert sorted(s.seq_id for s in first.seqs) == ids and all(s.next_token >= 0 for s in first.seqs)
    for seq_id, prompt in zip(ids, prompts, strict=True):
        logits = model.forward(np.array(prompt), np.arange(len(prompt)), DenseAttention(model.config),
                               all_logits=True)
        expected = [log_softmax(logits[p])[prompt[p + 1]] for p in range(len(prompt) - 1)]
        scores = engine.requests[seq_id].prompt_scores
        np.testing.assert_allclose(scores.chosen, expected, atol=2e-5)
        np.testing.assert_array_equal(scores.top_ids[:, 0], np.argmax(logits[:-1], axis=1))


def test_the_prefill_bench_rows():
    model = SYNTH.load()
    assert prefill_row(model, 3, tokens=24)["steps"] == 1
    result = run_prefill_bench(model, (1, 2), tokens=16)
    assert [r["concurrent"] for r in result["rows"]] == [1, 2] and result["sgemm_gflops"] > 0
    assert all(r["tokens_per_s"] > 0 and r["of_sgemm"] > 0 for r in result["rows"])
    assert "of sgemm" in "\n".join(format_prefill(result))

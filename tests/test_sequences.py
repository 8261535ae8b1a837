"""Many sequences over one pool: sharing never changes results, batching equals per-sequence forwards,
prefix caching hits what it should, preemption recomputes, fork continues."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import smollm2  # noqa: F401  (fixture)

from pagevis.engine import DecodeSession, SamplingConfig, SessionConfig
from pagevis.engine import Engine
from pagevis.engine.batch import BatchConfig
from pagevis.kvcache import CacheFullError, ConfigError
from pagevis.kvcache.prefix_cache import prefix_hashes
from pagevis.model.dense import DenseAttention
from pagevis.model.synthetic import SyntheticModel

MODEL = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
PROMPT = list(b"Pages let many sequences share one pool.")


def config(policy="none", max_pages=32, page_size=4, max_new_tokens=12, mode="sample", seed=5, **params):
    return SessionConfig(page_size=page_size, max_pages=max_pages, policy=policy, policy_params=params,
                         max_new_tokens=max_new_tokens, chat=False, sampling=SamplingConfig(mode=mode, seed=seed))


def alone(cfg: SessionConfig, prompt, seed):
    """What the single-sequence engine decodes for this prompt and seed."""
    sampling = SamplingConfig(mode=cfg.sampling.mode, seed=seed)
    session = DecodeSession(MODEL, "", SessionConfig(**{**cfg.__dict__, "sampling": sampling}), prompt_ids=prompt)
    list(session.run())
    return session.generated


@pytest.mark.parametrize("mode", ["sample", "greedy"])
def test_parallel_samples_decode_what_each_decodes_alone(mode):
    cfg = config(mode=mode)
    batch = Engine(MODEL, cfg)
    ids = batch.submit_parallel(PROMPT, 4)
    records = list(batch.run())
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, PROMPT, 5 + i)
    if mode == "sample":
        assert len({tuple(batch.requests[s].generated) for s in ids}) > 1, "differing seeds should differ"
    # the prompt is computed once and its pages are shared; each sample copies the partial last page
    assert records[0].seqs[0].n_tokens == len(PROMPT) and sum(s.n_tokens for s in records[0].seqs) == len(PROMPT)
    prompt_pages = -(-len(PROMPT) // 4)
    assert records[0].pages_used == prompt_pages and records[0].pages_unshared == 4 * prompt_pages
    cows = [e for r in records for e in r.events if e.kind == "copy_on_write" and e.layer == 0]
    assert len(cows) == (3 if len(PROMPT) % 4 else 0)
    assert all(e.page == prompt_pages - 1 for e in cows)


@pytest.mark.parametrize("policy,params", [("sinks", {"n_sink": 2}), ("h2o", {}), ("oldest-page", {}),
                                            ("random", {})])
def test_sequences_that_evict_decode_what_they_decode_alone(policy, params):
    cfg = config(policy, max_pages=4, max_new_tokens=20, **params)
    batch = Engine(MODEL, cfg)
    ids = [batch.submit(PROMPT[: 10 + 3 * i], sampling=SamplingConfig(mode="sample", seed=5 + i)) for i in range(4)]
    evictions = sum(e.kind == "evict" for r in batch.run() for e in r.events)
    assert evictions > 0
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, PROMPT[: 10 + 3 * i], 5 + i)


def test_eviction_from_a_shared_page_copies_it_first():
    cfg = config("sinks", max_pages=12, max_new_tokens=16, n_sink=1)
    batch = Engine(MODEL, cfg)
    ids = batch.submit_parallel(PROMPT, 3)
    records = list(batch.run())
    evicted_shared = [e for r in records for e in r.events if e.kind == "copy_on_write"]
    assert len(evicted_shared) > 3 * 2  # the partial page per layer, then shared full prompt pages
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, PROMPT, 5 + i)


class RecordingModel:
    """The model, keeping every forward's logits and the rows it ran."""

    def __init__(self, model):
        self.model, self.config, self.tokenizer = model, model.config, model.tokenizer
        self.calls = []

    def forward(self, token_ids, positions, attend, **kwargs):
        logits = self.model.forward(token_ids, positions, attend, **kwargs)
        self.calls.append((np.array(token_ids), np.array(positions), logits))
        return logits


def test_one_batched_forward_equals_dense_forwards_per_sequence():
    recording = RecordingModel(MODEL)
    batch = Engine(recording, config(max_new_tokens=6))
    prompts = [PROMPT[:9], PROMPT[3:20], PROMPT[5:11]]
    ids = [batch.submit(p, sampling=SamplingConfig(mode="sample", seed=i)) for i, p in enumerate(prompts)]
    list(batch.run())
    assert len(recording.calls) == 6  # one forward per step for all three sequences
    assert all(len(np.unique(positions[positions == 0])) <= 1 for _, positions, _ in recording.calls)
    for step, (_, _, logits) in enumerate(recording.calls):
        assert logits.shape == (3, MODEL.config.vocab_size)
        for row, seq_id in enumerate(ids):
            tokens = batch.requests[seq_id].tokens[: len(prompts[row]) + step]
            dense = MODEL.forward(np.array(tokens), np.arange(len(tokens)), DenseAttention(MODEL.config))
            rel = np.abs(logits[row] - dense).max() / np.abs(dense).max()
            assert rel < 1e-5, (step, seq_id, rel)


def test_prefix_hashes_hit_equal_prefixes_and_miss_from_a_changed_page():
    a = list(range(40))
    b = a.copy()
    b[21] = 99
    ha, hb = prefix_hashes(a, 4), prefix_hashes(b, 4)
    assert len(ha) == 10 and ha == prefix_hashes(list(a), 4)
    assert ha[:5] == hb[:5] and all(x != y for x, y in zip(ha[5:], hb[5:]))
    assert prefix_hashes(a[:7], 4) == ha[:1]

    batch = Engine(MODEL, config(max_new_tokens=2))
    first = batch.submit(a)
    list(batch.run())
    same, changed = batch.submit(a), batch.submit(b)
    record = batch.step()
    fed = {s.seq_id: s.n_tokens for s in record.seqs}
    assert fed == {same: 4, changed: 20}  # the last page is recomputed (its logits are needed); b misses from page 5
    assert batch.cache.prefix_stats.hits == 36 + 20 and batch.cache.prefix_stats.queries == 3 * 40
    assert first not in batch.cache.sequences
    list(batch.run())
    assert batch.requests[same].generated == batch.requests[first].generated


def test_freed_pages_stay_cached_until_the_pool_needs_them():
    batch = Engine(MODEL, config(max_new_tokens=1), BatchConfig(pool_pages=14))
    batch.submit(PROMPT[:32])
    list(batch.run())
    cached = batch.cache.stores[0].pages.cached_free()
    assert len(cached) == 8  # every full page, last page of the sequence first in line for reuse
    assert cached == sorted(cached, reverse=True)
    batch.submit(list(b"something else entirely, long enough to need pages"))
    list(batch.run())
    assert len(batch.cache.stores[0].pages.cached_free()) < 8 + 12
    again = batch.submit(PROMPT[:32])
    batch.step()
    assert batch.requests[again].n_cached > 1 + 16  # the oldest cached pages were reused first; the prefix survived


def test_preemption_takes_the_newest_sequence_and_recomputes_it():
    cfg = config("none", max_pages=16, max_new_tokens=20)
    batch = Engine(MODEL, cfg, BatchConfig(pool_pages=14, prefix_caching=False))
    ids = [batch.submit(PROMPT[:10 + i], sampling=SamplingConfig(mode="sample", seed=5 + i)) for i in range(4)]
    preempted = [e.seq for r in batch.run() for e in r.events if e.kind == "preempt"]
    assert preempted and batch.preemptions == len(preempted)
    assert preempted[0] == ids[-1]
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, PROMPT[:10 + i], 5 + i)


def test_a_pool_too_small_for_one_sequence_says_so():
    batch = Engine(MODEL, config(max_new_tokens=4), BatchConfig(pool_pages=2))
    batch.submit(PROMPT)
    with pytest.raises(CacheFullError, match="pool of 2 pages"):
        batch.step()
    with pytest.raises(ConfigError, match="max_seqs"):
        BatchConfig(max_seqs=0)


def test_fork_continues_from_a_recorded_step_with_other_settings():
    batch = Engine(MODEL, config(mode="greedy", max_new_tokens=14))
    parent = batch.submit(PROMPT)
    for _ in range(6):
        batch.step()
    n = len(PROMPT) + 3
    same = batch.fork(parent, n)
    other = batch.fork(parent, n, sampling=SamplingConfig(mode="sample", seed=11))
    assert batch.cache.block_table(same)[: n // 4 - 1] == batch.cache.block_table(parent)[: n // 4 - 1]
    list(batch.run())
    tail = batch.requests[parent].generated[3:]
    assert batch.requests[same].generated[3:3 + len(tail)] == tail[: 14 - 3]
    assert batch.requests[other].generated[:3] == batch.requests[parent].generated[:3]
    # a finished parent: its tokens become the prompt, and the prefix cache shares its full pages
    again = batch.fork(parent, n)
    batch.step()
    assert batch.cache.prefix_stats.hits >= (n - 1) // 4 * 4 - 4
    list(batch.run())
    assert batch.requests[again].generated[: len(tail) - 3] == tail[: len(tail) - 3]


def test_run_n_reports_pages_with_and_without_sharing(capsys):
    from pagevis.__main__ import main

    status = main(["run", "--model", "synthetic", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim",
                   "16", "--n", "4", "--json", "--quiet", "--max-tokens", "6", "--page-size", "4", "--max-pages", "40",
                   "--policy", "none", "--prompt", "a prompt long enough to fill several pages"])
    out, err = capsys.readouterr()
    assert status == 0, err
    result = json.loads(out)
    assert [s["seed"] for s in result["samples"]] == [0, 1, 2, 3]
    assert all(s["generated_tokens"] == 6 for s in result["samples"])
    prompt_pages = -(-result["prompt_tokens"] // 4)
    assert result["pages_without_sharing_peak"] >= 4 * prompt_pages > result["pages_used_peak"]
    assert result["copy_on_write"] == (3 if result["prompt_tokens"] % 4 else 0)
    assert main(["run", "--model", "synthetic", "--n", "0"]) == 2
    assert "--n 0" in capsys.readouterr().err
    assert main(["run", "--model", "synthetic", "--pool-pages", "3"]) == 2
    assert "--pool-pages only applies" in capsys.readouterr().err
    assert main(["run", "--model", "synthetic", "--int8-rows", "none"]) == 2
    assert "--int8-rows only applies" in capsys.readouterr().err
    assert main(["run", "--model", "synthetic", "--n", "2", "--int8-rows", "some"]) == 2
    assert "invalid choice: 'some' (choose from 'none', 'batched', 'prompts', 'all')" in capsys.readouterr().err


def test_sequences_bench_rows_on_a_small_model():
    from pagevis.bench.sequences import format_sequences, run_sequences_bench

    result = run_sequences_bench(MODEL, "synthetic", n_tokens=2, sizes=(1, 2, 4))
    assert [r["sequences"] for r in result["batching"]] == [1, 2, 4]
    assert all(r["tokens_per_s"] > 0 and r["steps"] >= 1 for r in result["batching"])
    parallel = result["parallel"]
    assert parallel["all_ran_to_length"]  # the synthetic model has no end-of-sequence token
    # 200-token prompt, 4 x 64 new tokens, 16-token pages: 12 shared full pages + 4 x 5 own pages
    assert (parallel["pages_used_peak"], parallel["pages_one_sequence"]) == (12 + 4 * 5, 17)
    assert parallel["pages_without_sharing_peak"] == 4 * 17 and parallel["copy_on_write"] == 3
    shared = result["shared_prompt"]
    assert shared["hit_tokens"][0] == 0 and shared["hit_rate_after_first"] >= 144 / 150
    assert len(format_sequences(result)) == 2 + 3 + 3
    assert "batched decode rows: " in format_sequences(result)[5]


@pytest.mark.parametrize("tier", [dict(disk_pages=16, max_pages=4), dict(select="quest", select_pages=2, max_pages=16)])
def test_many_sequences_with_a_disk_tier_or_quest_decode_what_each_decodes_alone(tier, tmp_path):
    """One engine for every combination: parallel samples over a disk tier (pages in swap files, RAM frames
    shared by all) or with Quest's page selection equal each seed decoded alone with the same settings."""
    cfg = replace(config(max_new_tokens=10), swap_dir=str(tmp_path), **tier)
    batch = Engine(MODEL, cfg)
    ids = batch.submit_parallel(PROMPT, 3, cfg.sampling)
    records = list(batch.run())
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, PROMPT, 5 + i)
    kinds = {e.kind for r in records for e in r.events}
    assert "share" in kinds  # the prompt's pages were shared, not copied
    if cfg.tiered:
        assert {"swap_out", "fault_in"} <= kinds  # three sequences in four RAM frames: pages moved
    batch.close()


@pytest.mark.slow
def test_smollm2_parallel_samples_and_batched_logits(smollm2):  # noqa: F811
    """The real model: three samples of one prompt decode what each decodes alone, and a batched step's
    logits equal a dense forward of each sequence (rel. err < 1e-5)."""
    cfg = SessionConfig(page_size=8, max_pages=16, policy="none", max_new_tokens=5,
                        sampling=SamplingConfig(mode="sample", temperature=1.0, seed=21))
    recording = RecordingModel(smollm2)
    batch = Engine(recording, cfg, BatchConfig(int8_rows="none"))  # (int8 rows: tests/test_int8_rows.py)
    ids = batch.submit_parallel(batch.encode("Name one use of paging."), 3)
    list(batch.run())
    for i, seq_id in enumerate(ids):
        session = DecodeSession(smollm2, "Name one use of paging.",
                                replace(cfg, sampling=replace(cfg.sampling, seed=21 + i)))
        list(session.run())
        assert batch.requests[seq_id].generated == session.generated
    _, _, logits = recording.calls[2]  # a decode step of all three
    for row, seq_id in enumerate(ids):
        tokens = batch.requests[seq_id].tokens[: len(batch.requests[seq_id].prompt_ids) + 2]
        dense = smollm2.forward(np.array(tokens), np.arange(len(tokens)), DenseAttention(smollm2.config))
        assert np.abs(logits[row] - dense).max() / np.abs(dense).max() < 1e-5


def test_a_full_cache_under_policy_none_ends_that_sequence_only():
    cfg = config("none", max_pages=6, max_new_tokens=30)  # 24 tokens per sequence
    batch = Engine(MODEL, cfg)
    short, long = batch.submit(PROMPT[:6]), batch.submit(PROMPT[:16])
    list(batch.run())
    assert batch.requests[long].stop_reason == "cache_full" and len(batch.requests[long].generated) == 24 - 16 + 1
    assert batch.requests[short].stop_reason == "cache_full" and len(batch.requests[short].generated) == 24 - 6 + 1
    assert batch.requests[short].generated[:5] == alone(replace(cfg, max_new_tokens=5), PROMPT[:6], 5)


def test_parallel_samples_of_a_prompt_too_long_for_policy_none_all_end_cache_full():
    batch = Engine(MODEL, config("none", max_pages=3))  # 12 tokens; the prompt has more
    ids = batch.submit_parallel(PROMPT, 3)
    list(batch.run())
    assert [batch.requests[s].stop_reason for s in ids] == ["cache_full"] * 3


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=5), pool_pages=st.integers(9, 30),
       new_tokens=st.integers(1, 10), shared=st.integers(0, 12), mode=st.sampled_from(["greedy", "sample"]))
def test_random_batches_decode_what_each_decodes_alone_and_free_everything(lengths, pool_pages, new_tokens,
                                                                            shared, mode):
    """Sequences joining between steps, sharing prompt prefixes (prefix cache), preempted when the pool is
    tight: each still decodes its own tokens, and at the end no page is referenced."""
    cfg = config("none", max_pages=10, max_new_tokens=new_tokens, mode=mode)  # 40 tokens: never full
    batch = Engine(MODEL, cfg, BatchConfig(pool_pages=pool_pages, max_seqs=3))
    prompts = [PROMPT[:shared] + PROMPT[20 + i: 20 + i + n] for i, n in enumerate(lengths)]
    ids = [batch.submit(p, sampling=SamplingConfig(mode=mode, seed=i)) for i, p in enumerate(prompts)]
    list(batch.run())
    for i, seq_id in enumerate(ids):
        assert batch.requests[seq_id].generated == alone(cfg, prompts[i], i)
    for blocks in (store.pages for store in batch.cache.stores):
        assert not blocks.ref_counts.any() and blocks.n_free() == pool_pages


def test_ignore_eos_decodes_the_asked_length():
    first = alone(config(mode="greedy", max_new_tokens=1), PROMPT, 0)[0]
    model = RecordingModel(MODEL)
    model.config = replace(MODEL.config, eos_ids=(first,))  # the first greedy token ends the sequence
    for ignore, expected in ((False, 1), (True, 5)):
        batch = Engine(model, config(mode="greedy", max_new_tokens=5), BatchConfig(ignore_eos=ignore))
        seq_id = batch.submit(PROMPT)
        list(batch.run())
        assert len(batch.requests[seq_id].generated) == expected


SYNTH_FLAGS = ["--model", "synthetic", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def test_run_n_over_a_disk_tier_equals_each_seed_alone(capsys, tmp_path):
    """`run --n 3 --sample --seed 5 --disk-pages 64 --max-pages 4`: each sample equals seed 5, 6, 7 run alone
    with the same tier (the disk tier and many sequences in one engine)."""
    from pagevis.__main__ import main

    common = [*SYNTH_FLAGS, "--prompt", "pages on disk and in RAM", "--no-chat", "--sample", "--max-tokens", "12",
              "--page-size", "4", "--disk-pages", "64", "--max-pages", "4", "--swap-dir", str(tmp_path), "--json",
              "--quiet"]
    assert main(["run", *common, "--n", "3", "--seed", "5"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    for i, sample in enumerate(samples):
        assert main(["run", *common, "--seed", str(5 + i)]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == sample["text"]
    assert os.listdir(tmp_path) == []  # every swap folder went with its run


def test_run_n_with_policy_none_and_a_prompt_longer_than_the_cache_exits_2_like_one_sequence(capsys):
    from pagevis.__main__ import main

    argv = [*SYNTH_FLAGS, "--prompt", "a prompt far longer than four tokens", "--no-chat", "--page-size", "2",
            "--max-pages", "2", "--policy", "none"]
    assert main(["run", *argv]) == 2
    alone_message = capsys.readouterr().err
    assert main(["run", *argv, "--n", "2"]) == 2
    assert capsys.readouterr().err == alone_message and "--policy none: the prompt is" in alone_message


def test_restart_takes_the_prompt_from_the_prefix_cache_and_decodes_the_same():
    cfg = config("none", max_pages=32, mode="greedy", max_new_tokens=6)
    session = DecodeSession(MODEL, "", cfg, prompt_ids=PROMPT)
    first = list(session.run())
    assert first[0].token_ids == tuple(PROMPT)  # one prefill chunk of the whole prompt
    generated = list(session.generated)
    session.restart()
    again = list(session.run())
    reused = (len(PROMPT) - 1) // 4 * 4  # its full pages, leaving the last token to compute
    assert again[0].positions[0] == reused and len(again[0].token_ids) == len(PROMPT) - reused
    hits = [e for e in again[0].events if e.kind == "prefix_hit"]
    assert [e.detail for e in hits] == [reused]
    assert session.generated == generated
    assert session.cache.prefix_stats.hits == reused and session.cache.prefix_stats.queries == 2 * len(PROMPT)

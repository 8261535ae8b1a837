"""Prompt rows in int8 (BatchConfig.int8_rows "prompts" / "all", model/int8_rows.py): the handles and quantised
arrays stay bounded whatever the row counts, a row's result does not depend on the rows beside it, SmolLM2's prompt
rows stay within the int8 bounds of the exact forward, a prompt's K/V are the same bit for bit whether it was fed
alone or beside other sequences' rows, and prompt scoring and `pagevis run`'s sessions stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from model_fixtures import smollm2  # noqa: F401  (fixture)
from test_int8_rows import Watching, log_softmax
from test_weight_kernels import random_blocks

from pagevis.engine import DecodeSession, Engine, SamplingConfig, SessionConfig
from pagevis.engine.batch import BatchConfig
from pagevis.model import DenseAttention, int8_rows, weight_threads
from pagevis.model.quantized import FORMATS, QuantMatrix, pack
from pagevis.model.synthetic import SyntheticModel

vnni = pytest.mark.skipif(int8_rows.route() != "vnni", reason="this CPU has no avx512_vnni (or PAGEVIS_NO_VNNI)")
CAPACITIES = [1 << k for k in range(9)]  # 1 .. MAX_ROWS
COUNTS = sorted({*range(1, 20), 31, 32, 33, 63, 65, 100, 127, 129, 200, 255, 256, 257, 300, 511, 600})


def bound_bytes(n_in: int, size: int) -> int:
    """The docstring's bound of one thread's quantised arrays for one input size: every capacity's codes, scales and
    sums."""
    return sum(CAPACITIES) * (n_in + 4 * n_in // 32 + 4 * n_in // size)


def thread_bytes(n_in: int) -> int:
    buffers = int8_rows._STATE.__dict__.get("buffers", {})
    return sum(a.nbytes for (held, inputs, _), arrays in buffers.items() if inputs == n_in for a in arrays)


@vnni
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q6_K], ids=["Q4_1", "Q6_K"])
def test_any_row_counts_keep_few_handles_and_bounded_buffers_and_each_row_as_in_any_product(kind):
    """Prompt chunks have any size: 34 row counts from 1 to 600 (over MAX_ROWS: cut into pieces) leave at most 9
    handles on the matrix (capacities 1, 2, 4, ..., 256) and this thread's quantised arrays within the docstring's
    bound; every row of every product is that row of the 600-row product bit for bit (a row does not depend on the
    rows beside it, nor on its piece), on one weight thread and on two."""
    rng = np.random.default_rng(int(kind) + 7)
    n_in = FORMATS[kind][3] * 5  # an input size no other test uses: this thread's buffers of it are this test's
    size = 16 if kind == Q.Q6_K else 32
    matrix = pack(kind, random_blocks(kind, 200, n_in, rng), n_in)
    x = rng.standard_normal((max(COUNTS), n_in)).astype(np.float32)
    with int8_rows.batched(True):
        whole = x @ matrix
        for threads in (1, 2):
            weight_threads.set_weight_threads(threads)
            try:
                for n in COUNTS:
                    assert np.array_equal((x[:n] @ matrix).view(np.int32), whole[:n].view(np.int32)), (threads, n)
            finally:
                weight_threads.set_weight_threads(1)
    assert set(matrix.int8_handles) <= set(CAPACITIES) and len(matrix.int8_handles) <= len(CAPACITIES)
    assert 0 < thread_bytes(n_in) <= bound_bytes(n_in, size)
    assert not np.array_equal(whole[:8], x[:8] @ matrix)  # (outside `batched`: exact, so int8 really ran)


def test_smollm2s_int8_arrays_are_bounded_as_the_docstring_says(smollm2):  # noqa: F811
    """The docstring's figure: every (input size, sum group) of SmolLM2's u4 / i8 matrices, all 9 capacities, under
    1.3 MiB a thread."""
    sizes = {(matrix.n_in, 16 if matrix.fmt == "i8" and matrix.arrays[3] > 1 else 32)
             for matrix in smollm2.weights.matrices() if isinstance(matrix, QuantMatrix) and matrix.fmt in ("u4", "i8")}
    assert sizes == {(576, 32), (1536, 32)}
    assert sum(bound_bytes(n_in, size) for n_in, size in sizes) <= 1.3 * 2**20


@vnni
def test_smollm2_prompt_rows_in_int8_stay_within_bounds_of_the_exact_forward(smollm2):  # noqa: F811
    """A 27-token prompt's every row in int8 (token rows and logits) against the exact float32 forward: max |diff|
    of the logits <= 2 (they span ~+-30; measured 1.23), KL(exact || int8) <= 0.05 nats a row (measured 0.017, mean
    0.004; the chat prompt "What is the capital of France?" 0.037 at its last row, mean 0.008), every top-1
    disagreement a near tie of the exact logits, and 85% agree (measured 25 of 27)."""
    ids = np.array(smollm2.tokenizer.encode("The kernel keeps a page table for every process, and a cache of "
                                            "recently used pages; when memory runs short it evicts the"))
    assert len(ids) == 27
    positions = np.arange(len(ids))
    exact = smollm2.forward(ids, positions, DenseAttention(smollm2.config), all_logits=True)
    with int8_rows.batched(True):
        got = smollm2.forward(ids, positions, DenseAttention(smollm2.config), all_logits=True)
    diff = np.abs(got - exact).max()
    assert 0 < diff <= 2.0
    p, q = log_softmax(exact), log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    assert kl.max() <= 0.05 and kl.mean() <= 0.01
    top = got.argmax(axis=-1)
    assert (exact[np.arange(len(got)), top] >= exact.max(axis=-1) - 2 * diff).all()
    assert (top == exact.argmax(axis=-1)).mean() >= 0.85


def prompt_kv(engine: Engine, seq_id: int, n: int) -> list[np.ndarray]:
    """The sequence's first n tokens' K and V in every layer, read from its pages (float32 pages: frame = page)."""
    out = []
    for layer, pages in enumerate(engine.cache.block_tables(seq_id)):
        store = engine.cache.stores[layer]
        for kv in zip(*(store.frame_kv(page, page + 1) for page in pages), strict=True):
            out.append(np.concatenate(kv, axis=1)[:, :n].copy())
    return out


def engine_for(model, mode: str, prefix_caching: bool = False) -> Engine:
    config = SessionConfig(page_size=8, max_pages=16, policy="none", max_new_tokens=6, chat=False,
                           sampling=SamplingConfig(mode="greedy"))
    return Engine(model, config, BatchConfig(max_seqs=4, int8_rows=mode, prefix_caching=prefix_caching))


@pytest.mark.parametrize("mode", ["prompts", "all"])
def test_a_prompts_kv_is_the_same_alone_or_beside_other_sequences_rows(smollm2, mode):  # noqa: F811
    """The server's int8 settings: a 28-token prompt fed alone, beside one sequence decoding (under "prompts" its
    row exact, the prompt's int8: masks), and beside two decoding (every row int8, one product): its K/V in every
    layer bit for bit the same, so a prefix cache holds one version of a prompt. Against the exact engine ("none")
    they differ (where the CPU has VNNI) but stay close: each layer's K and V within 8% of the exact ones (Frobenius
    norm of the difference over the norm)."""
    prompt = smollm2.tokenizer.encode("A page table maps each virtual page to a frame; the cache keeps the keys "
                                      "and values of every token the model has seen so far.")
    assert len(prompt) == 28
    kvs = []
    for neighbours in (0, 1, 2):
        engine = engine_for(smollm2, mode)
        others = [engine.submit(smollm2.tokenizer.encode(text)) for text in ("One two", "Red green blue")[:neighbours]]
        for _ in range(2 if neighbours else 0):  # the neighbours' prompts, then their second token
            engine.step()
        seq_id = engine.submit(prompt)
        record = engine.step()
        assert [s.kind for s in record.seqs] == ["decode"] * neighbours + ["prefill"] and len(others) == neighbours
        kvs.append(prompt_kv(engine, seq_id, len(prompt)))
    exact = engine_for(smollm2, "none")
    seq_id = exact.submit(prompt)
    exact.step()
    exact_kv = prompt_kv(exact, seq_id, len(prompt))
    for other in kvs[1:]:
        assert all(np.array_equal(a.view(np.int32), b.view(np.int32)) for a, b in zip(kvs[0], other, strict=True))
    same = all(np.array_equal(a, b) for a, b in zip(kvs[0], exact_kv, strict=True))
    assert same is (int8_rows.route() != "vnni")
    for a, b in zip(kvs[0], exact_kv, strict=True):  # measured: at most 0.045 (layer 0's K 0.003), mean 0.025
        assert np.linalg.norm(a - b) <= 0.08 * np.linalg.norm(b)


@pytest.mark.parametrize("mode", ["prompts", "all"])
def test_prompt_scoring_stays_exact_and_leaves_its_neighbours_int8(smollm2, mode):  # noqa: F811
    """A request scoring its prompt (echo, prompt logprobs) in a step beside another sequence decoding and a third's
    prompt: its scores and first token bit for bit what the exact engine ("none") gives, and the third's K/V bit
    for bit what they are when its prompt is fed alone under the same setting (the scoring request's rows alone are
    exact: a prompt's pages do not depend on who shares its step)."""
    prompt = smollm2.tokenizer.encode("The cache evicts the least recently used page when memory is full.")
    third = smollm2.tokenizer.encode("Paged attention reads keys where they lie.")
    results, kvs = [], []
    for engine_mode in (mode, "none"):
        engine = engine_for(smollm2, engine_mode)
        engine.submit(smollm2.tokenizer.encode("One two"))
        engine.step()
        seq_id = engine.submit(prompt, max_new_tokens=1, scores=(None, 2))
        other = engine.submit(third)
        record = engine.step()  # the first's decode row, the scored prompt and the third's prompt
        assert [s.kind for s in record.seqs] == ["decode", "prefill", "prefill"]
        scores = engine.requests[seq_id].prompt_scores
        results.append((scores.chosen.copy(), scores.top_ids.copy(), engine.last_logits[seq_id].copy()))
        kvs.append(prompt_kv(engine, other, len(third)))
    for got, want in zip(*results, strict=True):
        assert np.array_equal(got, want)
    alone = engine_for(smollm2, mode)
    seq_id = alone.submit(third)
    alone.step()
    assert all(np.array_equal(a, b) for a, b in zip(kvs[0], prompt_kv(alone, seq_id, len(third)), strict=True))
    same = all(np.array_equal(a, b) for a, b in zip(kvs[0], kvs[1], strict=True))
    assert same is (int8_rows.route() != "vnni")  # (the third's rows took int8 beside the scoring request)


@pytest.mark.parametrize("mode", ["batched", "all"])
def test_a_scored_prompts_exact_pages_are_no_other_requests_prefix_hit(smollm2, mode):  # noqa: F811
    """Under "all" (int8 prompt rows) a request scoring its prompt writes exact pages: they are cached under a salt of
    their own, so a later request with the same prompt finds none of them (it writes the int8 pages it writes
    alone); under "batched" every prompt row is exact, and the later request reuses the scored one's 3 full pages."""
    prompt = smollm2.tokenizer.encode("A page table maps each virtual page to a frame; the cache keeps the keys "
                                      "and values of every token the model has seen so far.")
    engine = engine_for(smollm2, mode, prefix_caching=True)
    scored = engine.submit(prompt, max_new_tokens=1, scores=(None, 2))
    list(engine.run())
    later = engine.submit(prompt, max_new_tokens=2)
    engine.step()
    vnni = int8_rows.route() == "vnni"
    assert engine.requests[scored].exact_pages is (vnni and mode == "all")
    assert engine.requests[later].prefix_hit_tokens == (0 if vnni and mode == "all" else 24)
    again = engine.submit(prompt, max_new_tokens=2)  # the later request's int8 pages are a hit as any others
    engine.step()
    assert engine.requests[again].prefix_hit_tokens == 24


def test_run_and_the_apps_sessions_never_take_int8_rows():
    """`pagevis run` and the app decode one sequence through DecodeSession, whose engine keeps the default
    "batched": no forward of its prompt or its decode steps enters int8 rows (so they stay bit for bit exact)."""
    model = Watching(SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3))
    session = DecodeSession(model, SessionConfig(page_size=4, max_pages=8, policy="sinks", max_new_tokens=6,
                                                 chat=False), prompt_ids=list(range(3, 14)))
    assert session.engine.batch.int8_rows == "batched"
    while not session.done:
        session.step()
    assert len(model.seen) >= 6 and not any(on for _, on, _ in model.seen)

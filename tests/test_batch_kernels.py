"""Several rows times the packed weights (model/batch_kernels.py): each row of a batched product equals that row
multiplied alone (the matrix-vector kernel) bit for bit, and the float64 product of gguf-py's dequantised weights
within float32 rounding, for every ggml type the packed formats hold, at row counts that fill the register blocks and
leave partial ones; and on the real model a batch of sequences decodes greedily what each sequence decodes alone."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize
from model_fixtures import smollm2  # noqa: F401  (fixture)
from test_weight_kernels import bound, random_blocks

from pagevis.engine import DecodeSession, Engine, SamplingConfig, SessionConfig
from pagevis.engine.batch import BatchConfig
from pagevis.model.batch_kernels import FAMILIES
from pagevis.model.quantized import FORMATS, POOL_ROWS, SMALL_BATCH, pack

KINDS = list(FORMATS)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_each_row_of_a_batch_equals_that_row_alone_and_the_float64_product(kind):
    """u5 (Q5_1, Q5_K) keeps weight_kernels' small-batch kernel: within float32 rounding of the row alone, not bit
    for bit."""
    rng = np.random.default_rng(int(kind))
    rows, n_in = 130, FORMATS[kind][3] * 3  # a partial last tile
    raw = random_blocks(kind, rows, n_in, rng)
    w = dequantize(raw, kind).reshape(rows, n_in).astype(np.float64)
    matrix = pack(kind, raw, n_in)
    for m in (2, 5, 7, SMALL_BATCH):
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        x[1] *= 1e4  # rows of very different sizes share a code block: each keeps its own bound
        got = x @ matrix
        x64 = x.astype(np.float64)
        limit = bound(w, x64, FORMATS[kind][1])
        assert (np.abs(got - x64 @ w.T) <= limit).all(), (m, kind.name)
        alone = np.stack([row @ matrix for row in x])
        if FORMATS[kind][0] == "u5":
            assert (np.abs(got - alone) <= 2 * limit).all(), (m, kind.name)
        else:
            assert np.array_equal(got, alone), (m, kind.name)


def test_the_formats_with_a_batch_kernel_are_the_ones_the_models_use():
    """u4 (Q4_0, Q4_1, Q4_K) and i8 (Q8_0, Q5_0, Q6_K) here; u5 (Q5_1, Q5_K) keeps weight_kernels' small-batch
    kernel (its result is checked above all the same). Each has a family's rows kernel (batch_kernels.FAMILIES)."""
    assert set(POOL_ROWS) == {"u4", "i8"} <= set(FAMILIES)
    assert {FORMATS[k][0] for k in KINDS} == {"u4", "u5", "i8"}


def test_preloaded_families_are_the_kernels_their_matrices_use():
    """quantized.preload_families (the test suite's background loader) loads the kernels a family's matrices call."""
    from gguf import GGMLQuantizationType as Q

    from pagevis.model import quantized

    quantized.preload_families(("u4",))
    rng = np.random.default_rng(3)
    matrix = pack(Q.Q4_1, random_blocks(Q.Q4_1, 64, 64, rng), 64)
    assert matrix.row_address == quantized._FAMILY_KERNELS[True, "u4"] != 0
    assert matrix.rows_address == quantized._FAMILY_KERNELS[False, "u4"] != 0


def test_loading_a_model_loads_its_families_kernels_before_its_first_product(monkeypatch):
    """gguf_loader preloads the kernels of the families a file's matrices hold (SmolLM2: Q4_1's u4 and Q8_0's i8,
    one row and rows), so a first launch compiles them while it loads, not in its first step."""
    from pagevis.model import gguf_loader, quantized
    from pagevis.model.matrix_descriptor import family as matrix_family
    from pagevis.model.quantized import QuantMatrix

    preloaded = []
    monkeypatch.setattr(quantized, "_FAMILY_KERNELS", {})
    monkeypatch.setattr(quantized, "preload_families", lambda families: preloaded.append(families))
    model = gguf_loader.load_model()
    assert preloaded == [("i8", "u4")]
    assert {matrix_family(m.descriptor) for m in model.weights.matrices() if isinstance(m, QuantMatrix)} == {"i8", "u4"}


@pytest.mark.slow
def test_smollm2_batched_greedy_decode_equals_each_sequence_alone(smollm2):  # noqa: F811
    """Eight sequences in one batch (every decode step a product of 8 rows by SmolLM2's Q4_1 and Q8_0 weights)
    decode greedily token for token what each decodes alone (one row a step)."""
    config = SessionConfig(page_size=16, max_pages=48, policy="none", max_new_tokens=12, chat=False,
                           sampling=SamplingConfig(mode="greedy"))
    prompts = ["The page table maps", "A cache evicts the", "Attention weights sum to", "The prime numbers below",
               "Copy-on-write means that", "A token is", "Memory is divided into", "The kernel schedules"]
    batch = Engine(smollm2, config, BatchConfig(max_seqs=len(prompts), int8_rows="none"))
    ids = [batch.submit(batch.encode(prompt)) for prompt in prompts]
    list(batch.run())
    for seq_id, prompt in zip(ids, prompts):
        session = DecodeSession(smollm2, prompt, config)
        list(session.run())
        assert batch.requests[seq_id].generated == session.generated, prompt

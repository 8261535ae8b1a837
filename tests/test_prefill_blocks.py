"""A long prefill's attention in blocks of queries and its feed-forward in blocks of rows (issue 43's memory): the
blocks change no bit of the outputs, the weights or a policy's statistics, and a block keeps its causal mask. With one
BLAS thread, as `pagevis` runs (--blas-threads 1): a gemm on several threads splits its rows its own way."""

from __future__ import annotations

import numpy as np
import pytest
from test_attention_kernel import reference

from pagevis.kvcache import CacheConfig, KVCacheManager
from pagevis.kvcache import attention_kernels as kernels
from pagevis import query_blocks
from pagevis.model import decoder, set_blas_threads
from pagevis.model.dense import DenseAttention
from pagevis.model.synthetic import SyntheticModel


@pytest.fixture(autouse=True)
def one_blas_thread():
    set_blas_threads(1)


def _problem(n_kv: int, group: int, d: int, n: int, dtype: str, seed: int = 0):
    """n queries over n + 9 keys in shuffled slots (some empty: bias -inf), each query at a distinct position."""
    rng = np.random.default_rng(seed)
    n_keys = n + 9
    q = rng.standard_normal((n, n_kv * group, d)).astype(np.float32)
    keys = rng.standard_normal((n_kv, n_keys, d)).astype(dtype)
    values = rng.standard_normal((n_kv, n_keys, d)).astype(dtype)
    key_positions = rng.permutation(n_keys).astype(np.int64)
    q_positions = np.sort(rng.choice(n_keys, n, replace=False)).astype(np.int64)
    bias = np.where(rng.random(n_keys) < 0.1, -np.inf, 0).astype(np.float32)
    return q, keys, values, bias, key_positions, q_positions


@pytest.mark.parametrize("n_kv, group, d, n, dtype, window", [
    (3, 3, 64, 449, "float32", None),  # SmolLM2's heads; 449 = 7 blocks of 64 and a last block of one query
    (1, 4, 256, 300, "float32", 40),  # Gemma 3's, a sliding window
    (2, 4, 16, 250, "float16", None),  # float16 keys converted chunk by chunk
])
def test_aligned_blocks_equal_one_block_bit_for_bit(monkeypatch, n_kv, group, d, n, dtype, window):
    q, keys, values, bias, key_positions, q_positions = _problem(n_kv, group, d, n, dtype)
    whole = kernels.attend(q, keys, values, bias, key_positions, q_positions, window)
    n_keys = keys.shape[1]
    monkeypatch.setattr(query_blocks, "SCORE_BYTES", 4 * n_kv * group * n_keys * 200)  # room for 200 queries a block
    rows = query_blocks.query_block(n_kv * group, n_keys, n_kv)
    assert 1 < rows < n and rows * group % query_blocks.ROW_ALIGN == 0
    blocked = kernels.attend(q, keys, values, bias, key_positions, q_positions, window)
    last = kernels.attend(q, keys, values, bias, key_positions, q_positions, window, all_weights=False)
    assert np.array_equal(blocked.output, whole.output) and np.array_equal(blocked.weights, whole.weights)
    assert np.array_equal(last.output, whole.output) and np.array_equal(last.weights, whole.weights[-1:])


@pytest.mark.parametrize("n_kv, group, d, n, dtype", [(3, 3, 64, 35, "float32"), (2, 4, 16, 20, "float16")])
def test_one_block_last_weights_only_are_the_whole_ones_last_row(n_kv, group, d, n, dtype):
    """A prompt chunk's attention in one block (the engine's: the last query's weights only, the others left
    unnormalised; the occupancy bias folded into the causal mask) gives every query's output and the last query's
    weights bit for bit as all the weights do, and they match float64."""
    q, keys, values, bias, key_positions, q_positions = _problem(n_kv, group, d, n, dtype, seed=5)
    assert query_blocks.query_block(n_kv * group, keys.shape[1], n_kv) >= n
    whole = kernels.attend(q, keys, values, bias, key_positions, q_positions)
    last = kernels.attend(q, keys, values, bias, key_positions, q_positions, all_weights=False)
    assert np.array_equal(last.output, whole.output) and np.array_equal(last.weights, whole.weights[-1:])
    out, weights = reference(q, keys, values, bias, key_positions, q_positions)
    assert np.abs(whole.output - out).max() < 1e-5 and np.abs(whole.weights - weights).max() < 1e-6


def test_unaligned_blocks_down_to_one_query_keep_the_causal_mask_and_match_float64(monkeypatch):
    q, keys, values, bias, key_positions, q_positions = _problem(2, 3, 32, 40, "float32", seed=3)
    monkeypatch.setattr(query_blocks, "SCORE_BYTES", 1)  # one query a block
    assert query_blocks.query_block(6, keys.shape[1], 2) == 1
    blocked = kernels.attend(q, keys, values, bias, key_positions, q_positions)
    out, weights = reference(q, keys, values, bias, key_positions, q_positions)
    assert np.abs(blocked.output - out).max() < 1e-5 and np.abs(blocked.weights - weights).max() < 1e-6
    assert not blocked.weights[:, :, key_positions > q_positions.max()].any()  # no query saw a later key


def _prefill(policy: str, prompt: int, all_weights: bool):
    """Each layer's attention output and the policy's statistics after one prefill of `prompt` tokens."""
    rng = np.random.default_rng(7)
    n_layers, n_heads, n_kv, d = 2, 6, 2, 16
    cache = KVCacheManager.single(CacheConfig(page_size=8, max_pages=prompt // 8 + 1, n_layers=n_layers,
                                              n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, policy=policy))
    positions = np.arange(prompt, dtype=np.int64)
    outputs, last = [], []
    for layer in range(n_layers):
        q = rng.standard_normal((prompt, n_heads, d)).astype(np.float32)
        k, v = (rng.standard_normal((prompt, n_kv, d)).astype(np.float32) for _ in range(2))
        result = cache.write_and_attend(0, layer, q, k, v, positions, all_weights=all_weights)
        outputs.append(result.output)
        last.append(result.weights[-1])
    states = [cache.layers[layer].table(cache.sequences[0]).state for layer in range(n_layers)]
    return outputs, last, [_statistics(state) for state in states]


def _statistics(state) -> dict:
    """A policy state's arrays (add_array's and its own attributes', e.g. snapkv's window rows) and counters."""
    found = {f"arrays.{name}": array.copy() for name, array in state.arrays.items()}
    found.update({name: np.array(value) for name, value in vars(state).items()
                  if isinstance(value, (np.ndarray, int, float)) and not isinstance(value, bool)})
    return found


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova", "none"])
def test_a_policys_statistics_after_a_blocked_prefill_are_the_whole_ones(monkeypatch, policy):
    # the engine asks for the last row only; a policy that reads them gets all (the last row only, with no policy
    # reading them: the chunk kernel, which takes no query blocks, its bits its own)
    wholes = {all_weights: _prefill(policy, 400, all_weights) for all_weights in (True, False)}
    whole = wholes[True]
    monkeypatch.setattr(query_blocks, "SCORE_BYTES", 4 * 6 * 408 * 100)  # 64 queries a block (group 3: 192 rows)
    for all_weights in (True, False):
        blocked, whole = _prefill(policy, 400, all_weights), wholes[all_weights]
        for a, b in zip(whole[0] + whole[1], blocked[0] + blocked[1], strict=True):
            assert np.array_equal(a, b)
        for a, b in zip(whole[2], blocked[2], strict=True):
            assert a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)
    if policy != "none":
        assert any(array.any() for state in whole[2] for array in state.values())  # statistics were kept


def test_the_feed_forward_in_row_blocks_and_dense_attention_in_query_blocks_change_no_logit(monkeypatch):
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=3)
    ids = np.random.default_rng(1).integers(0, 256, 500)
    positions = np.arange(500)

    def logits():
        return model.forward(ids, positions, DenseAttention(model.config), all_logits=True)

    whole = logits()
    monkeypatch.setattr(decoder, "MLP_ROWS", 192)  # 192, 192, 116
    assert np.array_equal(logits(), whole)
    monkeypatch.setattr(query_blocks, "SCORE_BYTES", 4 * 4 * 500 * 100)  # 96 queries a block (group 2: 192 rows)
    assert query_blocks.query_block(4, 500, 2) == 96
    assert np.array_equal(logits(), whole)

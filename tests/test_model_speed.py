"""The speed helpers others' benchmarks import (quick checks on a synthetic model)."""

from __future__ import annotations

import numpy as np

from pagevis.model import set_blas_threads
from pagevis.bench.bandwidth import measure_copy_bandwidth, measure_decode_speed, weight_bytes_per_token
from pagevis.model.synthetic import SyntheticModel


def test_weight_bytes_count_every_matrix_once_and_one_embedding_row():
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
    d, q, kv, ff, vocab = 32, 32, 16, 64, 256
    per_layer = d + d * (q + 2 * kv) + q * d + d + d * 2 * ff + ff * d
    assert weight_bytes_per_token(model) == 4 * (2 * per_layer + d + d * vocab + d)


def test_copy_bandwidth_and_decode_speed_are_positive():
    assert measure_copy_bandwidth(nbytes=8 << 20, repeats=2) > 0
    assert measure_decode_speed(SyntheticModel(n_layers=1), n_tokens=4, prompt_length=3) > 0


def test_blas_threads_can_be_limited_without_changing_results():
    a = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32)
    before = a @ a
    assert isinstance(set_blas_threads(1), bool)
    np.testing.assert_allclose(a @ a, before, rtol=1e-5, atol=1e-5)

"""kvcache/decode_kernel.attend_split: a lone sequence's decode attention with its keys cut into parts shared with the
spin pool's helper thread and merged (flash-decoding's partials). Against a float64 softmax over exactly the keys each
head may see (several key counts and part counts, an occupancy bias, per-KV-head masks, a sliding window, the new
token's write); and bit for bit the same whoever computes each part (the helper, the caller alone, a helper that
stalls on a part)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pagevis.kvcache import attention_kernels
from pagevis.kvcache import decode_kernel as kernel

_KERNEL_TYPE = ctypes.CFUNCTYPE(None, *(ctypes.c_int64,) * 7)


class CallerOnly:
    """SpinPool.items with no helper thread: every part computed by the caller, through the pool's kernel."""

    def items(self, address, job, handle, arrays, out, count):
        assert out.size % count == 0 and job[kernel.TILES_WORD] % count == 0
        _KERNEL_TYPE(address)(job.ctypes.data, handle.ctypes.data, 1, 0, int(job[kernel.TILES_WORD]), out.ctypes.data,
                              out.size)


def problem(n_kv, group, d, n_keys, seed, masked="some", per_head=False, window=0):
    """A pool of n_keys + spare slots, its bias (None, one row, or one a KV head), positions, and a new token."""
    rng = np.random.default_rng(seed)
    slots = n_keys + 9
    k = rng.standard_normal((n_kv, slots, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, slots, d)).astype(np.float32)
    q = (2 * rng.standard_normal((1, n_kv * group, d))).astype(np.float32)
    rows = n_kv if per_head else 1
    bias = np.where(rng.random((rows, slots)) < 0.3, -np.inf, 0).astype(np.float32)
    if masked == "all":
        bias[:] = -np.inf
    if per_head and n_kv > 1:
        bias[1] = -np.inf  # a KV head that sees no key
    positions = rng.permutation(slots).astype(np.int64)
    slot = int(rng.integers(n_keys))  # the new token's slot, among those read
    new = rng.standard_normal((n_kv, d)).astype(np.float32), rng.standard_normal((n_kv, d)).astype(np.float32)
    return k, v, q, None if masked == "none" else (bias if per_head else bias[0]), positions, slot, new


def run(k, v, q, bias, positions, slot, new, n_keys, window, pool):
    """attend_decode through the pool (copies of the pool's K/V: the call writes the new token)."""
    k, v = k.copy(), v.copy()
    position = int(positions[:n_keys].max())
    result = attention_kernels.attend_decode(q, k, v, n_keys, bias, positions if window else None, position,
                                             window or None, (slot, *new), pool)
    return result, k, v


def reference(q, k, v, bias, positions, n_keys, window):
    """Float64 attention over the first n_keys slots, each KV head over the keys it may see."""
    n_kv, _, d = k.shape
    group = q.shape[1] // n_kv
    position = positions[:n_keys].max()
    visible = np.ones((n_kv, n_keys), bool) if bias is None else np.isfinite(bias.reshape(-1, bias.shape[-1])[
        :, :n_keys]) & np.ones((n_kv, 1), bool)
    if window:
        visible &= (positions[:n_keys] > position - window) & (positions[:n_keys] <= position)
    out, weights = np.zeros((q.shape[1], d)), np.zeros((q.shape[1], n_keys))
    for g in range(q.shape[1]):
        seen = visible[g // group]
        if not seen.any():
            continue
        scores = k[g // group, :n_keys][seen].astype(np.float64) @ q[0, g].astype(np.float64) / np.sqrt(d)
        e = np.exp(scores - scores.max())
        weights[g, seen] = e / e.sum()
        out[g] = weights[g, seen] @ v[g // group, :n_keys][seen].astype(np.float64)
    return out, weights, visible


@pytest.mark.parametrize("n_kv, group, d, n_keys, parts, masked, per_head, window", [
    (3, 3, 64, 256, 2, "some", False, 0), (3, 3, 64, 513, 2, "none", False, 0), (1, 4, 256, 700, 2, "some", False, 50),
    (1, 4, 256, 1024, 3, "some", False, 0), (2, 5, 16, 300, 4, "some", True, 0), (3, 3, 64, 1999, 8, "some", False, 0),
    (2, 2, 32, 31, 2, "none", False, 0), (2, 3, 16, 5, 4, "some", True, 3), (1, 1, 8, 333, 2, "all", False, 0),
    (4, 2, 64, 4096, 2, "some", True, 1000)])
def test_the_split_matches_float64_and_writes_the_new_token(n_kv, group, d, n_keys, parts, masked, per_head, window,
                                                           monkeypatch):
    """Every part count and key count (a short last part, parts of a few keys, keys fewer than parts' alignment):
    output and normalised weights within float32 rounding of float64, exactly 0 where hidden; the new token's K/V
    in its slot before the keys are read; and within float32 rounding of attend_one's."""
    monkeypatch.setattr(kernel, "PARTS", parts)
    monkeypatch.setattr(kernel, "SPLIT_KEYS", 1)
    k, v, q, bias, positions, slot, new = problem(n_kv, group, d, n_keys, n_keys + parts, masked, per_head, window)
    got, k_after, v_after = run(k, v, q, bias, positions, slot, new, n_keys, window, CallerOnly())
    assert np.array_equal(k_after[:, slot], new[0]) and np.array_equal(v_after[:, slot], new[1])
    want_out, want_weights, visible = reference(q, k_after, v_after, bias, positions, n_keys, window)
    assert got.weights.shape == (1, n_kv * group, n_keys)
    assert np.all(got.weights[0][~np.repeat(visible, group, axis=0)] == 0), "hidden keys weigh exactly 0"
    np.testing.assert_allclose(got.weights[0], want_weights, atol=2e-6)
    np.testing.assert_allclose(got.output[0], want_out, atol=2e-5 * max(1.0, np.abs(want_out).max()))
    one, _, _ = run(k, v, q, bias, positions, slot, new, n_keys, window, None)
    np.testing.assert_allclose(got.weights, one.weights, atol=1e-6)
    np.testing.assert_allclose(got.output, one.output, atol=1e-5)


def test_the_split_is_the_same_bits_whoever_computes_each_part():
    """Two weight threads: the parts shared with the spin pool's helper give the bits of the caller computing every
    part alone; so do the helper taking every part (the test plays it, from its scratch) and a helper stalling on
    one (the caller computes it again). The pool's constants are the kernel's. Below SPLIT_KEYS, attend_one's."""
    from pagevis.model import quantized, spin_pool as sp, weight_threads

    assert (kernel.TILE, kernel.DESCRIPTOR, kernel.TILES_WORD) == (sp.TILE, sp.DESCRIPTOR, sp.TILES)
    for n_kv, group, d, n_keys, window in ((3, 3, 64, 600, 0), (1, 4, 256, 1100, 400)):
        k, v, q, bias, positions, slot, new = problem(n_kv, group, d, n_keys, n_keys, "some", n_kv > 1, window)
        alone, _, _ = run(k, v, q, bias, positions, slot, new, n_keys, window, CallerOnly())
        weight_threads.set_weight_threads(2)
        try:
            pool = quantized.spin_pool()
            assert pool is not None
            for _ in range(5):  # the parts fall to either thread differently each time
                shared, _, _ = run(k, v, q, bias, positions, slot, new, n_keys, window, pool)
                assert np.array_equal(shared.output.view(np.int32), alone.output.view(np.int32))
                assert np.array_equal(shared.weights.view(np.int32), alone.weights.view(np.int32))
        finally:
            weight_threads.set_weight_threads(1)
        short, _, _ = run(k, v, q, bias, positions, slot, new, kernel.SPLIT_KEYS - 1, window, CallerOnly())
        one, _, _ = run(k, v, q, bias, positions, slot, new, kernel.SPLIT_KEYS - 1, window, None)
        assert np.array_equal(short.weights, one.weights) and np.array_equal(short.output, one.output)
        for stalled in (False, True):
            played = PlayedPool(sp, stalled)
            got, _, _ = run(k, v, q, bias, positions, slot, new, n_keys, window, played)
            assert played.seen == ((0, 1) if stalled else (played.count, 0))
            assert np.array_equal(got.output.view(np.int32), alone.output.view(np.int32))
            assert np.array_equal(got.weights.view(np.int32), alone.weights.view(np.int32))


class PlayedPool:
    """SpinPool.items with the helper played here: it takes every part into its scratch, or claims part 0 and never
    finishes it (stalled); the caller's side is the pool's own (spin_pool.run)."""

    def __init__(self, sp, stalled):
        self.sp, self.stalled, self.seen, self.count = sp, stalled, None, 0

    def items(self, address, job, handle, arrays, out, count):
        sp = self.sp
        ctrl, scratch = sp.new_control(), np.full(out.size, np.nan, np.float32)
        assert sp._post(ctrl, job, 5, handle.ctypes.data, 1, out.size, scratch, address, count) == count
        if not self.stalled:
            sp.help_job(ctrl, int(ctrl[sp.NEXT]))
        ctrl[sp.NEXT] += self.stalled
        sp.run(ctrl, 5, count, out, scratch)
        self.seen, self.count = (int(ctrl[sp.HELPED]), int(ctrl[sp.TAKEN_OVER])), count

"""Float16 pages read and written in place by the decode kernels (through uint16 views: numba has no float16 on the
CPU). The conversions against NumPy's bit for bit: kernel_intrinsics.widen over every finite float16, half_bits
(float32 -> float16, to nearest, ties to even) over ties, subnormals, overflow and random bits. The one-sequence
kernel (attend_one, attend_split on one and two threads) and the batched one (attend_tables, its spin-pool path and
its write) on float16 pages against a float64 softmax over the float16-rounded K/V, with K/V of many magnitudes
(float16 subnormals, values near 65504, both signs), and within float32 rounding of the same kernels over those
values in float32 pages; the batched one of the NumPy float16 path (attention_kernels.attend_decode_batch) too."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from pagevis.kernel_intrinsics import narrow, widen
from pagevis.kvcache import attention_kernels
from pagevis.kvcache import batch_decode_kernel as batch
from pagevis.kvcache import decode_kernel as kernel


@njit
def _widened(bits, out):  # pragma: no cover (numba)
    for i in range(bits.size):
        out[i] = widen(bits[i])


@njit
def _narrowed(values, out):  # pragma: no cover (numba)
    for i in range(values.size):
        out[i] = narrow(values[i], out)


@pytest.mark.parametrize("instruction", [None, False])
def test_widen_is_numpys_float16_to_float32_for_every_finite_float16(instruction, monkeypatch):
    """The CPU's conversion where it has one (F16C here), and the integer operations of a CPU without (compiled anew
    with HALF_INSTRUCTIONS off)."""
    from pagevis import kernel_intrinsics

    monkeypatch.setattr(kernel_intrinsics, "HALF_INSTRUCTIONS", instruction)
    convert = _widened if instruction is None else njit(_widened.py_func)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = every[(every & 0x7C00) != 0x7C00]  # (inf and NaN are never stored)
    got = np.empty(finite.size, np.float32)
    convert(finite, got)
    assert np.array_equal(got.view(np.uint32), finite.view(np.float16).astype(np.float32).view(np.uint32))


def test_half_bits_round_as_numpys_astype_float16():
    """Ties (halfway between neighbouring float16s, either way of even), just off them, subnormals and their ties,
    float16's largest and beyond (to inf), float32 subnormals, zeros of both signs, and random float32 bits."""
    rng = np.random.default_rng(3)
    halves = np.arange(0x7C00, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    ties = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)  # exact in float32 (float16's mantissa + 1 bit)
    edges = np.array([65504, 65519.996, 65520, 65536, 1e9, 2 ** -14, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -26,
                      1e-40, 0.0, 6.1e-5, 5.96e-8], np.float32)
    randoms = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0)),
                             halves.astype(np.float32), edges, randoms[np.isfinite(randoms)]])
    values = np.concatenate([values, -values])
    got = np.empty(values.size, np.uint16)
    _narrowed(values, got)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


def _keys(rng, shape):
    """float16 keys of many magnitudes, one a token: normal, float16 subnormals (below 2^-14) and large, both signs."""
    scale = rng.choice(np.array([1.0, 3e-6, 2e-7, 300.0], np.float32), size=shape[:-1] + (1,))
    return (rng.standard_normal(shape).astype(np.float32) * scale).astype(np.float16)


def _values(rng, shape):
    """float16 values of one magnitude a KV head: subnormal, normal, near float16's largest (65504), both signs."""
    scale = np.array([3e-6, 1.0, 2e4], np.float32)[np.arange(shape[0]) % 3].reshape(-1, *(1,) * (len(shape) - 1))
    return (rng.standard_normal(shape).astype(np.float32) * scale).clip(-65504, 65504).astype(np.float16)


def _reference(q, keys, values, visible):
    """Float64 attention of q (n_heads, d) over keys, values (n_kv, T, d) where visible (n_kv, T)."""
    n_heads, d = q.shape
    group = n_heads // keys.shape[0]
    out, weights = np.zeros((n_heads, d)), np.zeros((n_heads, keys.shape[1]))
    for g in range(n_heads):
        seen = visible[g // group]
        if not seen.any():
            continue
        scores = keys[g // group][seen].astype(np.float64) @ (q[g].astype(np.float64) / np.sqrt(d))
        e = np.exp(scores - scores.max())
        weights[g, seen] = e / e.sum()
        out[g] = weights[g, seen] @ values[g // group][seen].astype(np.float64)
    return out, weights


def _assert_near(got_out, got_weights, want_out, want_weights, values, visible_weights):
    assert np.all(got_weights[~visible_weights] == 0)
    np.testing.assert_allclose(got_weights, want_weights, atol=1e-5)
    # each output element within float32 rounding of the weighted sum of its values' magnitudes (a subnormal value
    # read as a normal one, or a wrong exponent, is off by far more)
    bound = want_weights @ np.abs(values.astype(np.float64))
    assert np.all(np.abs(got_out - want_out) <= 1e-4 * bound), np.abs(got_out - want_out).max()


class _CallerOnly:
    """SpinPool.items with no helper thread: every part computed by the caller, through the pool's kernel."""

    def items(self, address, job, handle, arrays, out, count):
        import ctypes

        ctypes.CFUNCTYPE(None, *(ctypes.c_int64,) * 7)(address)(
            job.ctypes.data, handle.ctypes.data, 1, 0, int(job[kernel.TILES_WORD]), out.ctypes.data, out.size)


@pytest.mark.parametrize("n_kv, group, d, n_keys, split", [(3, 3, 64, 300, False), (3, 3, 64, 300, True),
                                                           (1, 4, 256, 700, True), (2, 2, 16, 33, False)])
def test_one_sequence_reads_float16_pages_in_place(n_kv, group, d, n_keys, split, monkeypatch):
    """attend_decode over float16 pages (attend_one, or attend_split's parts through the pool's kernel): the new
    token's K/V rounded into its slot as NumPy rounds them; output and weights within float32 rounding of float64
    over the stored values and of the float32 kernel's over the same values in float32 pages (its sums vectorised
    alike, not always in the same order)."""
    monkeypatch.setattr(kernel, "SPLIT_KEYS", 1 if split else 1 << 30)
    rng = np.random.default_rng(n_keys + split)
    slots = n_keys + 5
    k, v = _keys(rng, (n_kv, slots, d)), _values(rng, (n_kv, slots, d))
    q = (0.05 * rng.standard_normal((1, n_kv * group, d))).astype(np.float32)
    bias = np.where(rng.random(slots) < 0.2, -np.inf, 0).astype(np.float32)
    slot = int(rng.integers(n_keys))
    bias[slot] = 0
    new_k, new_v = (rng.standard_normal((n_kv, d)).astype(np.float32) * scale for scale in (300, 1e-5))
    pool = _CallerOnly() if split else None
    got = attention_kernels.attend_decode(q, k, v, n_keys, bias, None, 0, None, (slot, new_k, new_v), pool)
    assert np.array_equal(k[:, slot].view(np.uint16), new_k.astype(np.float16).view(np.uint16))
    assert np.array_equal(v[:, slot].view(np.uint16), new_v.astype(np.float16).view(np.uint16))
    visible = np.broadcast_to(np.isfinite(bias[:n_keys]), (n_kv, n_keys))
    want_out, want_weights = _reference(q[0], k[:, :n_keys], v[:, :n_keys], visible)
    for g in range(n_kv * group):
        _assert_near(got.output[0, g], got.weights[0, g], want_out[g], want_weights[g], v[g // group, :n_keys],
                     visible[g // group])
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    same = attention_kernels.attend_decode(q, k32, v32, n_keys, bias, None, 0, None, None, pool)
    _assert_float32_rounding(got, same)


def _assert_float32_rounding(got, want):
    """Output and weights within float32 rounding of want's."""
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
    off = np.abs(got[0] - want[0]) / np.abs(want[0]).max(axis=-1, keepdims=True)  # (each head's own magnitude)
    assert np.all(off <= 1e-5), off.max()


def _batch_problem(seed, n_kv=3, group=3, d=64, page_size=16, frames=40, batch=7):
    rng = np.random.default_rng(seed)
    k, v = _keys(rng, (n_kv, frames, page_size, d)), _values(rng, (n_kv, frames, page_size, d))
    q = (0.05 * rng.standard_normal((batch, n_kv * group, d))).astype(np.float32)
    n_pages = rng.integers(1, 5, batch)
    pages = rng.permutation(frames)
    tables = np.zeros((batch, n_pages.max()), np.int64)
    for b, n in enumerate(np.cumsum(n_pages)):
        tables[b, :n_pages[b]] = pages[n - n_pages[b]:n]
    bias = np.where(rng.random(frames * page_size) < 0.2, -np.inf, 0).astype(np.float32)
    key_positions = rng.permutation(frames * page_size).astype(np.int64)
    positions = rng.integers(0, frames * page_size, batch)
    return q, k, v, tables, n_pages, bias, key_positions, positions


@pytest.mark.parametrize("window", [0, 300])
def test_several_sequences_read_float16_pages_in_place(window):
    """attend_tables over float16 pages: within float32 rounding of float64 over the stored values, of the NumPy
    float16 path (gathered, attend_decode_batch) and of the kernel over the same values in float32 pages; on the spin
    pool's two threads bit for bit one thread's."""
    from pagevis.model import quantized, weight_threads

    q, k, v, tables, n_pages, bias, key_positions, positions = _batch_problem(5 + window)
    n_kv, _, page_size, d = k.shape
    group = q.shape[1] // n_kv
    args = (tables, n_pages, bias, key_positions, positions, window)
    out, weights = batch.attend_tables(q, k, v, *args)
    for b in range(len(q)):
        flats = (tables[b, :n_pages[b], None] * page_size + np.arange(page_size)).ravel()
        seen = np.isfinite(bias[flats]) & ((key_positions[flats] > positions[b] - window) if window else True)
        keys = k.reshape(n_kv, -1, d)[:, flats]
        values = v.reshape(n_kv, -1, d)[:, flats]
        want_out, want_weights = _reference(q[b], keys, values, np.broadcast_to(seen, (n_kv, len(flats))))
        for g in range(n_kv * group):
            _assert_near(out[b, g], weights[b, g, :len(flats)], want_out[g], want_weights[g], values[g // group], seen)
        assert not weights[b, :, len(flats):].any()
    if not window:  # the NumPy float16 path (no window: its caller masks one)
        flat = tables[:, :, None] * page_size + np.arange(page_size)
        gathered_bias = bias[flat].reshape(len(q), -1)
        gathered_bias[np.arange(flat[0].size)[None, :] >= n_pages[:, None] * page_size] = -np.inf
        keys = k[:, tables].reshape(n_kv, len(q), -1, d)
        values = v[:, tables].reshape(n_kv, len(q), -1, d)
        numpy_out, numpy_weights = attention_kernels.attend_decode_batch(q, keys, values, gathered_bias)
        _assert_float32_rounding((out, weights), (numpy_out, numpy_weights))
    same = batch.attend_tables(q, k.astype(np.float32), v.astype(np.float32), *args)
    weight_threads.set_weight_threads(2)
    try:
        pool = quantized.spin_pool()
        assert pool is not None
        shared = batch.attend_tables(q, k, v, *args, pool=pool)
    finally:
        weight_threads.set_weight_threads(1)
    _assert_float32_rounding(same, (out, weights))
    assert np.array_equal(shared[0].view(np.int32), out.view(np.int32))
    assert np.array_equal(shared[1].view(np.int32), weights.view(np.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_tokens_written_into_float16_pages_round_as_numpy(threads):
    """write_rows and attend_tables' `write` into float16 pages: the K/V NumPy's astype(float16) gives (float32 tokens
    of many magnitudes, rounded), and the same attention after either."""
    from pagevis.model import quantized, weight_threads

    q, k, v, tables, n_pages, bias, key_positions, positions = _batch_problem(17)
    n_kv, frames, page_size, d = k.shape
    batch_size = len(q)
    rng = np.random.default_rng(23)
    last = tables[np.arange(batch_size), n_pages - 1]
    fill = np.full(frames, page_size, np.int64)
    flats = last * page_size + page_size - 1
    bias[flats] = -np.inf
    key_positions[flats] = -1
    fill[last] -= 1
    new_k, new_v = (values.astype(np.float32) * np.float32(1.00048) for values in (  # (rounded when written)
        _keys(rng, (batch_size, n_kv, d)), _values(rng, (n_kv, batch_size, d)).clip(-65000, 65000).transpose(1, 0, 2)))
    stores = [tuple(a.copy() for a in (k, v, key_positions, fill, bias)) for _ in range(2)]
    weight_threads.set_weight_threads(threads)
    try:
        pool = quantized.spin_pool() if threads > 1 else None
        sk, sv, skp, sfill, sbias = stores[0]
        batch.write_rows(sk.reshape(n_kv, -1, d), sv.reshape(n_kv, -1, d), skp, sfill, sbias, flats,
                         np.arange(batch_size), new_k, new_v, positions, page_size)
        want = batch.attend_tables(q, sk, sv, tables, n_pages, sbias, skp, positions, 0, pool)
        hk, hv, hkp, hfill, hbias = stores[1]
        got = batch.attend_tables(q, hk, hv, tables, n_pages, hbias, hkp, positions, 0, pool,
                                  (flats, new_k, new_v, hfill))
    finally:
        weight_threads.set_weight_threads(1)
    for stored, new in ((sk, new_k), (sv, new_v)):
        assert np.array_equal(stored[:, last, page_size - 1].transpose(1, 0, 2).view(np.uint16),
                              new.astype(np.float16).view(np.uint16))
    for a, b in zip(stores[0], stores[1], strict=True):
        assert np.array_equal(a.view(np.uint8) if a.dtype == np.float16 else a, b.view(np.uint8)
                              if b.dtype == np.float16 else b)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.view(np.int32), w.view(np.int32))


def test_a_float16_caches_batched_decode_is_single_appends_and_attention():
    """KVCacheManager.decode_many on float16 pages (batch_writes.write_many's held tokens, written by attend_tables'
    call) leaves the K/V bits, positions and fills that one `append` per sequence leaves (NumPy's rounding), and
    attends within float32 rounding of each sequence's own `attend` (the one-sequence kernel)."""
    from pagevis.kvcache import CacheConfig, KVCacheManager

    config = CacheConfig(page_size=4, max_pages=8, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16, policy="none",
                         dtype="float16")
    rng = np.random.default_rng(29)
    caches = [KVCacheManager(config, pool_pages=40) for _ in range(2)]
    lengths = [3, 9, 6]
    for cache in caches:
        for seq, length in enumerate(lengths):
            cache.add_sequence(seq)
    for seq, length in enumerate(lengths):  # prompts, written alike
        k, v = (rng.standard_normal((length, 2, 16)).astype(np.float32) for _ in range(2))
        for cache in caches:
            cache.append(seq, 0, k, v, np.arange(length))
    seqs = list(range(len(lengths)))
    for step in range(7):  # tokens across page boundaries
        positions = np.array(lengths) + step
        q = rng.standard_normal((len(seqs), 6, 16)).astype(np.float32)
        k, v = (rng.standard_normal((len(seqs), 2, 16)).astype(np.float32) * scale for scale in (1, 50))
        batched = caches[0].decode_many(seqs, 0, q, k, v, positions, wanted=tuple(seqs))
        assert batched is not None
        for seq in seqs:
            caches[1].append(seq, 0, k[seq:seq + 1], v[seq:seq + 1], positions[seq:seq + 1])
            alone = caches[1].attend(seq, 0, q[seq:seq + 1], positions[seq:seq + 1])
            result = batched[1][seq]
            np.testing.assert_array_equal(alone.slots, result.slots)
            _assert_float32_rounding((result.output, result.weights), (alone.output, alone.weights))
        stores = [cache.layers[0].store for cache in caches]
        assert np.array_equal(stores[0].k.view(np.uint16), stores[1].k.view(np.uint16))
        assert np.array_equal(stores[0].v.view(np.uint16), stores[1].v.view(np.uint16))
        assert np.array_equal(stores[0].positions, stores[1].positions)
        assert np.array_equal(stores[0].fill, stores[1].fill)

"""The policies' numba kernels (kvcache/policies/kernels.py) choose what their NumPy definitions choose: KeyDiff's
victim against the base rule over `score` (the lowest outside the window, ties to the oldest token), merge's survivor
against the einsum over every survivor (the first on a tie), on random layers where many keys repeat (exact ties).
NumPy's product (BLAS) may score two equal keys a rounding apart, the kernel scores them alike: so the kernel's victim
must be the oldest of the tokens within float64 rounding of NumPy's lowest score, when those are all the same key."""

import numpy as np
import pytest

from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.policies.kernels import most_similar
from pagevis.kvcache.policies.keydiff import KeyDiff, UnitKeys, unit_keys
from pagevis.kvcache.policy_state import LayerView


def random_layer(rng, n_slots, n_kv, d):
    """Positions (some slots empty) and unit keys drawn from a few distinct keys, so that scores tie."""
    positions = np.full(n_slots, -1)
    resident = int(rng.integers(1, n_slots))
    positions[rng.choice(n_slots, resident, replace=False)] = rng.choice(1000, resident, replace=False)
    state = UnitKeys(n_slots, n_kv, d)
    distinct = rng.standard_normal((int(rng.integers(1, 6)), n_kv, d)).astype(np.float32)
    state.unit[:] = unit_keys(distinct[rng.integers(0, len(distinct), n_slots)])
    return positions, state


def test_keydiff_kernel_chooses_what_the_base_rule_chooses():
    rng = np.random.default_rng(5)
    compared = 0
    for _ in range(300):
        n_kv, d, window = int(rng.integers(1, 4)), int(rng.choice([4, 64])), int(rng.integers(0, 10))
        positions, state = random_layer(rng, 40, n_kv, d)
        pages = LayerView(0, 8, positions, [], state)
        policy = KeyDiff(window=window)
        policy.bind(64, 8)
        policy.bind_heads(n_kv, n_kv, d, 10000.0)
        if (positions >= 0).sum() <= window:
            with pytest.raises(RuntimeError, match="no evictable token"):
                policy.choose_victims(pages)
            continue
        victims, scores = policy.choose_victims(pages)
        base_victims, base_scores = EvictionPolicy.choose_victims(policy, pages)
        reference = policy.score(pages)
        candidates = np.flatnonzero((positions >= 0) & ~policy.protected(pages))
        near = candidates[reference[candidates] <= base_scores[0] + 1e-12]
        assert victims[0] in near
        np.testing.assert_allclose(scores, base_scores, rtol=1e-12)
        if all((state.unit[near] == state.unit[near[0]]).all(axis=(1, 2))):  # one key: a true tie
            assert victims[0] == near[np.argmin(positions[near])]
        else:
            assert victims.tolist() == base_victims.tolist()
        compared += 1
    assert compared > 200


def test_merge_kernel_finds_the_most_similar_survivor():
    rng = np.random.default_rng(6)
    for _ in range(300):
        positions, state = random_layer(rng, 40, 3, 16)
        survivors = positions >= 0
        victim = int(rng.choice(np.flatnonzero(survivors)))
        survivors[victim] = False
        candidates = np.flatnonzero(survivors)
        if not len(candidates):
            assert most_similar(state.unit, survivors, victim) == -1
            continue
        similarity = np.einsum("shd,hd->s", state.unit[candidates].astype(np.float64), state.unit[victim])
        assert most_similar(state.unit, survivors, victim) == candidates[np.argmax(similarity)]


def test_snapkv_head_scores_are_the_pooled_window_sums():
    from pagevis.kvcache.policies.snapkv import ObservationWindow, SnapKV

    rng = np.random.default_rng(7)
    for _ in range(200):
        window, kernel = int(rng.integers(1, 9)), int(rng.choice([1, 3, 7, 101]))
        positions, _ = random_layer(rng, 48, 1, 4)
        state = ObservationWindow(48, window, 3)
        state.rows[:] = rng.random(state.rows.shape) * (rng.random(state.rows.shape) < 0.7)
        pages = LayerView(0, 16, positions, [], state)
        policy = SnapKV(window=window, kernel=kernel)
        policy.bind(64, 16)
        expected = policy._pooled(pages, state.window_attention())
        assert np.array_equal(policy.head_scores(pages), expected)  # the same float64 values, not within rounding


def adakv_drops_by_lexsort(scores, kept, positions, protected, n_safe, need):
    """AdaKV's drops as NumPy sorts them (the policy's code before its kernel)."""
    tier = np.where(protected[None, :], 2, 0) * kept
    for head in range(len(kept)):
        rows = np.flatnonzero(kept[head])
        best = rows[np.lexsort((-positions[rows], -scores[head, rows]))[:n_safe]]
        tier[head, best] = np.maximum(tier[head, best], 1)
    heads, slots = np.nonzero(kept)
    order = np.lexsort((heads, positions[slots], scores[heads, slots], tier[heads, slots]))[:need]
    return heads[order], slots[order]


def test_adakv_kernel_drops_what_the_lexsorts_drop():
    from pagevis.kvcache.policies.kernels import adakv_drops

    rng = np.random.default_rng(8)
    for _ in range(400):
        n_kv, n_slots = int(rng.integers(1, 4)), 40
        positions, _ = random_layer(rng, n_slots, 1, 4)
        kept = (positions >= 0)[None, :] & (rng.random((n_kv, n_slots)) < 0.8)
        scores = rng.integers(0, 5, size=(n_kv, n_slots)) / 4  # coarse: ties everywhere
        protected = (positions >= 0) & (rng.random(n_slots) < 0.2)
        n_safe, need = int(rng.integers(0, 12)), int(rng.integers(1, 3 * n_kv + 2))
        heads, slots = adakv_drops(scores, kept, positions, protected, n_safe, need)
        expected = adakv_drops_by_lexsort(scores, kept, positions, protected, n_safe, need)
        assert heads.tolist() == expected[0].tolist() and slots.tolist() == expected[1].tolist()


def test_expected_attention_moments_kernel_equals_the_numpy_update():
    """Decoding's one-query update (numba, with the unrotation's cos/sin shared by the layers) gives the same float64
    moments as the batch update NumPy does for several queries, fed one query at a time."""
    from pagevis.kvcache.policies.expected_attention import QueryMoments

    rng = np.random.default_rng(9)
    fast, slow = QueryMoments(8, 6, 2, 16, 10000.0, 4), QueryMoments(8, 6, 2, 16, 10000.0, 4)
    for position in range(60):
        q = rng.standard_normal((1, 6, 16)).astype(np.float32)
        fast.query(q, np.array([position]))
        # the batch path, two copies of the query with one of them at a sink position (dropped): n = 1 there too
        slow.query(np.concatenate([q, q]), np.array([0, position]) if position >= 4 else np.array([0, 1]))
    assert fast.count == slow.count == 56
    assert np.array_equal(fast.mean, slow.mean) and np.array_equal(fast.deviations, slow.deviations)

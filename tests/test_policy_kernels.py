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


def test_adakv_one_call_drops_what_snapkv_scores_and_the_lexsorts_drop():
    """AdaKV over SnapKV in one numba call: SnapKV's pooled window attention per KV head (NumPy), its window, the
    drops by lexsort, the same scores bit for bit; nothing when the heads hold fewer than n_kv x budget entries."""
    from pagevis.kvcache.policies.adakv import AdaKV
    from pagevis.kvcache.policies.base import newest
    from pagevis.kvcache.policies.snapkv import ObservationWindow

    rng = np.random.default_rng(10)
    dropped = 0
    for _ in range(300):
        n_kv, n_slots, window = int(rng.integers(1, 4)), 48, int(rng.integers(1, 6))
        positions, _ = random_layer(rng, n_slots, 1, 4)
        state = ObservationWindow(n_slots, window, n_kv)
        state.rows[:] = rng.integers(0, 4, state.rows.shape) / 8  # coarse: ties
        keep = rng.random((n_kv, n_slots)) < 0.8
        policy = AdaKV(budget=int(rng.integers(1, 40)), safeguard_pct=int(rng.integers(0, 60)))
        policy.bind(64, 16)
        policy.inner.window, policy.inner.kernel = window, int(rng.choice([1, 3, 7]))
        policy.bind_layers(1)
        policy.bind_heads(n_kv, n_kv, 4, 10000.0)
        pages = LayerView(0, 16, positions, [], state, keep)
        assert policy._snapkv() is policy.inner
        heads, slots, scores = policy.choose_head_victims(pages)
        kept = keep & (positions >= 0)[None, :]
        need = int(kept.sum()) + n_kv - n_kv * policy.budget
        assert policy.head_room(pages) == (n_kv * policy.budget - int(kept.sum())) // n_kv
        if need <= 0:
            assert len(heads) == len(slots) == len(scores) == 0
            continue
        reference = policy.inner._pooled(pages, state.window_attention())
        expected = adakv_drops_by_lexsort(reference, kept, positions, newest(pages, window), policy.n_safe, need)
        assert heads.tolist() == expected[0].tolist() and slots.tolist() == expected[1].tolist()
        assert np.array_equal(scores, reference[heads, slots])
        dropped += len(heads)
    assert dropped > 100


def test_head_mask_bias_is_the_masks_added_to_the_occupancy_bias():
    from pagevis.kvcache.paged_attention import kept_bias

    rng = np.random.default_rng(11)
    for _ in range(200):
        n_kv, n = int(rng.integers(1, 4)), int(rng.integers(1, 30))
        keep = rng.random((n_kv, n)) < 0.7
        if rng.random() < 0.3:  # every slot kept by every head or by none: no head differs
            keep = np.broadcast_to(keep[:1], (n_kv, n)).copy()
        bias = None if rng.random() < 0.3 else np.where(rng.random(n) < 0.8, 0, -np.inf).astype(np.float32)
        differ = not (keep.all(axis=0) | ~keep.any(axis=0)).all()
        got = kept_bias(keep[:, :n], bias)
        if not differ:
            assert got is bias
            continue
        expected = np.where(keep, np.float32(0), np.float32(-np.inf)) + (0 if bias is None else bias)
        assert got.dtype == np.float32 and np.array_equal(got, expected)


def test_observation_window_kernel_keeps_numpys_means():
    """A decode query's weights per KV head (its query heads' mean): the kernel's rows equal NumPy's bit for bit,
    for groups of 1 to 9 query heads."""
    from pagevis.kvcache.policies.snapkv import ObservationWindow

    rng = np.random.default_rng(12)
    for group in range(1, 10):
        n_kv, n_slots, m = int(rng.integers(1, 4)), 40, int(rng.integers(1, 40))
        fast, slow = ObservationWindow(n_slots, 3, n_kv), ObservationWindow(n_slots, 3, n_kv)
        for _ in range(5):
            weights = rng.random((1, n_kv * group, m), dtype=np.float32) ** 3
            fast.observe(weights, slice(0, m))
            slow.observe(weights, np.arange(m))  # (slots as an array: NumPy's path)
        assert fast.next == slow.next and np.array_equal(fast.rows, slow.rows)


def test_h2o_kernel_chooses_what_the_base_rule_chooses():
    from pagevis.kvcache.policies.h2o import AccumulatedAttention, HeavyHitter

    rng = np.random.default_rng(13)
    for _ in range(300):
        positions, _ = random_layer(rng, 40, 1, 4)
        state = AccumulatedAttention(40)
        state.accumulated[:] = rng.integers(0, 6, 40) / 4  # coarse: ties
        policy = HeavyHitter(recent=int(rng.integers(0, 30)))
        policy.bind(64, 8)
        pages = LayerView(0, 8, positions, [], state)
        if (positions >= 0).sum() <= policy.recent:
            with pytest.raises(RuntimeError, match="no evictable token"):
                policy.choose_victims(pages)
            continue
        victims, scores = policy.choose_victims(pages)
        expected = EvictionPolicy.choose_victims(policy, pages)
        assert victims.tolist() == expected[0].tolist() and np.array_equal(scores, expected[1])


def merge_targets_by_einsum(unit, positions, victims, accumulated):
    """Each victim's most similar survivor (the einsum of its cosines over the tokens that stay), its weight
    a_v / (a_s + a_v) (0.5 if both are 0); the survivor then carries a_s + a_v."""
    staying = np.flatnonzero((positions >= 0) & ~np.isin(np.arange(len(positions)), victims))
    if not len(staying):
        return np.full(len(victims), -1), np.zeros(len(victims))
    found = []
    for victim in victims:
        target = staying[np.argmax(np.einsum("shd,hd->s", unit[staying].astype(np.float64), unit[victim]))]
        total = accumulated[target] + accumulated[victim]
        found.append((target, accumulated[victim] / total if total > 0 else 0.5))
        accumulated[target] = total
    return np.array([t for t, _ in found]), np.array([w for _, w in found])


def test_merge_targets_kernel_is_the_loop_over_victims():
    from pagevis.kvcache.policies.kernels import merge_targets

    rng = np.random.default_rng(14)
    for _ in range(300):
        positions, state = random_layer(rng, 24, 3, 16)
        resident = np.flatnonzero(positions >= 0)
        victims = rng.choice(resident, int(rng.integers(1, len(resident) + 1)), replace=False)
        accumulated = rng.integers(0, 4, 24) / 3  # zeros too: weight 0.5
        mine, theirs = accumulated.copy(), accumulated.copy()
        targets, weights = merge_targets(state.unit, positions, victims, mine)
        expected = merge_targets_by_einsum(state.unit, positions, victims, theirs)
        assert targets.tolist() == expected[0].tolist() and np.array_equal(weights, expected[1])
        assert np.array_equal(mine, theirs)


def test_fold_value_kernel_rounds_as_numpy():
    from pagevis.kvcache.policies.kernels import fold_value

    rng = np.random.default_rng(15)
    v = rng.standard_normal((3, 4, 8, 16)).astype(np.float32)
    for _ in range(200):
        page, slot, weight = int(rng.integers(0, 4)), int(rng.integers(0, 8)), float(rng.random())
        values = rng.standard_normal((3, 2, 16)) * 3
        expected = ((1 - weight) * v[:, page, slot].astype(np.float64) + weight * values[:, 1]).astype(np.float32)
        fold_value(v, page, slot, values[:, 1], weight)
        assert np.array_equal(v[:, page, slot], expected)


def test_unit_keys_kernel_is_numpys_norm_bit_for_bit():
    """A token's float32 keys scaled by the kernel (NumPy's pairwise float32 sum of squares replayed) equal
    k / np.linalg.norm(k) exactly: head sizes under 8, blocks of 8, past 128 (halves), zero keys, overflow."""
    rng = np.random.default_rng(16)
    for case in range(600):
        n_kv, d = int(rng.integers(1, 4)), int(rng.choice([3, 8, 12, 64, 100, 129, 256, 300]))
        k = (rng.standard_normal((n_kv, d)) * 10.0 ** rng.uniform(-20, 19)).astype(np.float32)
        if case % 7 == 0:
            k[0] = 0
        with np.errstate(over="ignore"):
            norm = np.linalg.norm(k, axis=-1, keepdims=True)
        out = np.empty_like(k)
        assert unit_keys(k, out) is out
        assert np.array_equal(out, k / np.where(norm > 0, norm, 1), equal_nan=True)

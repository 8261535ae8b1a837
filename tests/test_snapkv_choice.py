"""SnapKV chooses its victim with the resident tokens sorted once (its own choose_victims): the same victim and
score as the base rule (the lowest score outside the protected window, ties to the oldest token), on random layers
with many ties, every kernel width (wider than the cache too) and window."""

import numpy as np
import pytest

from pagevis.kvcache.policies.base import EvictionPolicy
from pagevis.kvcache.policies.snapkv import ObservationWindow, SnapKV
from pagevis.kvcache.policy_state import LayerView


def test_snapkv_chooses_what_the_base_rule_chooses():
    rng = np.random.default_rng(3)
    compared = 0
    for _ in range(600):
        n_slots, window, kernel = 48, int(rng.integers(1, 12)), int(rng.choice([1, 3, 7, 101]))
        positions = np.full(n_slots, -1)
        resident = int(rng.integers(1, 40))
        positions[rng.choice(n_slots, resident, replace=False)] = rng.choice(1000, resident, replace=False)
        state = ObservationWindow(n_slots, window)
        state.rows[:] = rng.integers(0, 4, size=state.rows.shape) / 4  # coarse values: ties everywhere
        pages = LayerView(0, 16, positions, [], state)
        policy = SnapKV(window=window, kernel=kernel)
        policy.bind(64, 16)
        if resident <= window:
            with pytest.raises(RuntimeError, match="no evictable token"):
                policy.choose_victims(pages)
            continue
        victims, scores = policy.choose_victims(pages)
        base_victims, base_scores = EvictionPolicy.choose_victims(policy, pages)
        assert victims.tolist() == base_victims.tolist() and scores.tolist() == base_scores.tolist()
        compared += 1
    assert compared > 400

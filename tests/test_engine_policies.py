"""Each policy's retained set equals a brute-force simulation of its definition, step by step.

The simulation keeps a plain list of resident positions and computes attention itself (float64, via
the dense reference), so it shares no code with the engine's pages, scores or victim selection.
"""

import numpy as np
import pytest

from engine_reference import dense_attention_f64
from pagevis.engine import CacheConfig, CacheFullError, EventKind, PagedKVCache

N_KV, GROUP, HEAD_DIM = 2, 2, 8
N_HEADS = N_KV * GROUP


class BruteForce:
    """The policies as their papers define them, over a list of resident token positions."""

    def __init__(self, policy, capacity, page_size, params):
        self.policy, self.capacity, self.page_size, self.params = policy, capacity, page_size, params
        self.resident: list[int] = []
        self.accumulated: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.pages: list[list[int]] = []  # oldest-page only: tokens grouped by the page they entered

    def append(self, position):
        if self.policy == "oldest-page":
            if not self.pages or len(self.pages[-1]) == self.page_size:
                if len(self.pages) == self.capacity // self.page_size:
                    for gone in self.pages.pop(0):
                        self.resident.remove(gone)
                self.pages.append([])
            self.pages[-1].append(position)
        elif len(self.resident) == self.capacity:
            self.resident.remove(self.victim())
        self.resident.append(position)
        self.accumulated[position] = 0.0

    def victim(self):
        by_age = sorted(self.resident)
        if self.policy == "oldest":
            return by_age[0]
        if self.policy == "sinks":
            return next(p for p in by_age if p >= self.params.get("n_sink", 4))
        if self.policy == "h2o":
            recent = self.params.get("recent", self.capacity // 2)
            older = by_age[: len(by_age) - recent]
            return min(older, key=lambda p: (self.accumulated[p], p))
        if self.policy == "tova":
            return min(by_age, key=lambda p: (self.last[p], p))
        raise AssertionError(self.policy)

    def observe(self, weights_by_position):
        for position, w in weights_by_position.items():
            self.accumulated[position] += w
        self.last = dict(weights_by_position)


def run_both(policy, page_size, max_pages, n_tokens, seed, params=None):
    params = params or {}
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=1, n_heads=N_HEADS,
                         n_kv_heads=N_KV, head_dim=HEAD_DIM, policy=policy, policy_params=params)
    cache = PagedKVCache(config)
    brute = BruteForce(policy, config.capacity, page_size, params)
    rng = np.random.default_rng(seed)
    keys, values = {}, {}
    for position in range(n_tokens):
        k = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
        # peaked queries give some tokens far more attention than others, as in real models
        q = (2.5 * rng.standard_normal((1, N_HEADS, HEAD_DIM))).astype(np.float32)
        keys[position], values[position] = k[0], v[0]
        cache.step = position
        cache.append(0, k, v, np.array([position]))
        cache.attend(0, q, np.array([position]))
        brute.append(position)
        _, weights = dense_attention_f64(q[0], np.stack([keys[p] for p in brute.resident]),
                                         np.stack([values[p] for p in brute.resident]))
        brute.observe(dict(zip(brute.resident, weights.mean(axis=0))))
        assert sorted(brute.resident) == cache.resident_positions(0).tolist(), f"differs at step {position}"
    return cache


@pytest.mark.parametrize("policy", ["oldest", "sinks", "h2o", "tova", "oldest-page"])
@pytest.mark.parametrize("page_size,max_pages", [(1, 7), (4, 3), (8, 4), (5, 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_retained_set_matches_brute_force(policy, page_size, max_pages, seed):
    run_both(policy, page_size, max_pages, n_tokens=4 * page_size * max_pages + 3, seed=seed)


@pytest.mark.parametrize("params", [{"n_sink": 0}, {"n_sink": 1}, {"n_sink": 11}])
def test_sinks_parameter(params):
    cache = run_both("sinks", 4, 3, 40, seed=5, params=params)
    kept = cache.resident_positions(0)
    assert kept[: params["n_sink"]].tolist() == list(range(params["n_sink"]))


@pytest.mark.parametrize("params", [{"recent": 0}, {"recent": 3}, {"recent": 11}])
def test_h2o_parameter(params):
    cache = run_both("h2o", 4, 3, 40, seed=6, params=params)
    kept = cache.resident_positions(0).tolist()
    assert kept[len(kept) - params["recent"]:] == list(range(40 - params["recent"], 40))


def test_h2o_keeps_heavy_hitters_that_oldest_drops():
    """A sanity check that the policies differ: h2o keeps some old token a sliding window lost."""
    h2o = set(run_both("h2o", 4, 4, 60, seed=3).resident_positions(0).tolist())
    window = set(run_both("oldest", 4, 4, 60, seed=3).resident_positions(0).tolist())
    assert h2o != window and min(h2o) < min(window)


def test_oldest_page_frees_whole_pages_in_block_table_order():
    cache = run_both("oldest-page", 4, 3, 13, seed=0)
    events = cache.take_events()
    evicted = [e.position for e in events if e.kind is EventKind.EVICT]
    released = [e.page for e in events if e.kind is EventKind.RELEASE]
    assert evicted == [0, 1, 2, 3] and released == [0]
    assert cache.block_table(0) == [1, 2, 0]


def test_random_is_seeded_and_uniformish():
    def evicted(seed):
        config = CacheConfig(page_size=4, max_pages=4, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                             policy="random", policy_params={"seed": seed})
        cache = PagedKVCache(config)
        x = np.zeros((1, 1, 2), np.float32)
        for p in range(400):
            cache.append(0, x, x, np.array([p]))
        return [e.position for e in cache.take_events() if e.kind is EventKind.EVICT]

    assert evicted(7) == evicted(7)
    assert evicted(7) != evicted(8)
    # a uniform choice among 16 residents leaves each token about 16 steps on average
    ages = np.arange(16, 400) - np.array(evicted(7))
    assert 10 < ages.mean() < 22
    assert len(set(evicted(7))) == len(evicted(7))


def test_none_refuses_when_full_without_changing_anything():
    config = CacheConfig(page_size=2, max_pages=2, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                         policy="none")
    cache = PagedKVCache(config)
    x = np.zeros((1, 1, 2), np.float32)
    for p in range(4):
        cache.append(0, x, x, np.array([p]))
    assert not cache.can_append(1)
    with pytest.raises(CacheFullError, match=r"cache is full.*4 tokens.*2 pages x 2.*policy 'none'"):
        cache.ensure_room(1)
    assert cache.resident_positions(0).tolist() == [0, 1, 2, 3]

"""Invariants of the page pool over random sequences of appends, attention, evictions and resets."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagevis.engine import CacheConfig, EventKind, PagedKVCache

N_LAYERS, N_KV, HEAD_DIM = 2, 2, 4


class PagePoolMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.integers(1, 6),
        max_pages=st.integers(1, 6),
        policy=st.sampled_from(["oldest", "oldest-page", "sinks", "h2o", "tova", "random"]),
        seed=st.integers(0, 1000),
    )
    def setup(self, page_size, max_pages, policy, seed):
        params = {"n_sink": min(2, page_size * max_pages - 1)} if policy == "sinks" else {}
        self.config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=N_LAYERS,
                                  n_heads=2 * N_KV, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                                  policy=policy, policy_params=params)
        self.cache = PagedKVCache(self.config)
        self.rng = np.random.default_rng(seed)
        self.next_position = 0
        # what the events say is resident, per layer: replaying events must give the cache's state
        self.replayed = [dict() for _ in range(N_LAYERS)]  # position -> (page, slot)

    def _replay(self):
        for event in self.cache.take_events():
            resident = self.replayed[event.layer]
            if event.kind is EventKind.WRITE:
                assert event.position not in resident, "a token was written twice"
                resident[event.position] = (event.page, event.slot)
            elif event.kind is EventKind.EVICT:
                assert resident.pop(event.position) == (event.page, event.slot)
                assert event.policy == self.config.policy and event.reason

    @rule(n=st.integers(1, 4), layer=st.integers(0, N_LAYERS - 1))
    def append(self, n, layer):
        shape = (n, N_KV, HEAD_DIM)
        positions = np.arange(self.next_position, self.next_position + n)
        self.next_position += n
        self.cache.step += 1
        self.cache.append(layer, self.rng.standard_normal(shape).astype(np.float32),
                          self.rng.standard_normal(shape).astype(np.float32), positions)
        self._replay()

    @rule(layer=st.integers(0, N_LAYERS - 1))
    def attend(self, layer):
        if self.cache.stores[layer].resident:
            q = self.rng.standard_normal((1, 2 * N_KV, HEAD_DIM)).astype(np.float32)
            result = self.cache.attend(layer, q, np.array([self.next_position]))
            np.testing.assert_allclose(result.weights.sum(-1), 1, rtol=1e-5)

    @rule()
    def reset(self):
        self.cache.reset()
        self.next_position = 0
        self.replayed = [dict() for _ in range(N_LAYERS)]
        for layer, pages in enumerate(self.cache.stores):
            assert pages.resident == 0 and not self.cache.block_table(layer) and not pages.holes
            assert sorted(pages.frames.free) == list(range(self.config.max_pages))
            assert not pages.frames.ref_counts.any()
            assert np.all(pages.positions == -1) and np.all(np.isneginf(pages.bias))
        assert self.cache.take_events() == []

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "cache"):
            return
        ps, max_pages = self.config.page_size, self.config.max_pages
        for layer, pages in enumerate(self.cache.stores):
            table = self.cache.block_table(layer)
            slots = pages.positions.reshape(max_pages, ps)
            occupied = slots >= 0
            resident = slots[occupied]
            assert resident.size <= self.config.capacity
            assert len(np.unique(resident)) == resident.size, "a token sits in two slots"
            assert len(pages.frames.free) + len(table) == max_pages
            assert len(set(table)) == len(table)
            assert not set(table) & set(pages.frames.free)
            # one sequence: a page is referenced once exactly when its sequence's block table holds it
            assert np.array_equal(np.flatnonzero(pages.frames.ref_counts), sorted(table))
            assert set(pages.frames.ref_counts.tolist()) <= {0, 1}
            for page in range(max_pages):
                in_table = page in table
                assert occupied[page].sum() == pages.fill[page] <= ps
                assert in_table == (pages.fill[page] > 0), "block table disagrees with the slot map"
            # holes are exactly the empty slots of allocated pages
            expected_holes = {p * ps + s for p in table for s in range(ps) if not occupied[p, s]}
            assert pages.holes == expected_holes
            assert np.array_equal(np.isfinite(pages.bias), pages.positions >= 0)
            assert pages.high_water == (max(table) + 1 if table else 0)
            # every token that left has an eviction event: replayed events equal the slot map
            replayed = self.replayed[layer]
            assert {p: (int(a), int(b)) for p, (a, b) in replayed.items()} == {
                int(slots[a, b]): (int(a), int(b)) for a, b in zip(*np.nonzero(occupied))}


PagePoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestPagePool = PagePoolMachine.TestCase

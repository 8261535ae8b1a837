"""Invariants of the page pool over random sequences of appends, attention, evictions and resets."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagevis.kvcache import CacheConfig, EventKind, KVCacheManager

N_LAYERS, N_KV, HEAD_DIM = 2, 2, 4


class PagePoolMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.integers(1, 6),
        max_pages=st.integers(1, 6),
        policy=st.sampled_from(["oldest", "oldest-page", "sinks", "h2o", "tova", "random"]),
        seed=st.integers(0, 1000),
        ram_frames=st.sampled_from([None, None, 2, 3]),  # a disk tier of max_pages pages, this many RAM frames
        select=st.sampled_from(["all", "quest"]),
    )
    def setup(self, page_size, max_pages, policy, seed, ram_frames, select):
        params = {"n_sink": min(2, page_size * max_pages - 1)} if policy == "sinks" else {}
        tier = {"max_pages": ram_frames, "disk_pages": max_pages} if ram_frames else {"max_pages": max_pages}
        self.config = CacheConfig(page_size=page_size, n_layers=N_LAYERS, n_heads=2 * N_KV, n_kv_heads=N_KV,
                                  head_dim=HEAD_DIM, policy=policy, policy_params=params, select=select,
                                  select_pages=2, **tier)
        self.n_pages = max_pages
        self.cache = KVCacheManager.single(self.config)
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
        self.cache.append(0, layer, self.rng.standard_normal(shape).astype(np.float32),
                          self.rng.standard_normal(shape).astype(np.float32), positions)
        self._replay()

    @rule(layer=st.integers(0, N_LAYERS - 1))
    def attend(self, layer):
        if self.cache.stores[layer].resident:
            q = self.rng.standard_normal((1, 2 * N_KV, HEAD_DIM)).astype(np.float32)
            result = self.cache.attend(0, layer, q, np.array([self.next_position]))
            np.testing.assert_allclose(result.weights.sum(-1), 1, rtol=1e-5)

    @rule()
    def reset(self):
        self.cache.reset()
        self.next_position = 0
        self.replayed = [dict() for _ in range(N_LAYERS)]
        for layer, pages in enumerate(self.cache.stores):
            assert pages.resident == 0 and not self.cache.block_table(0, layer) and not self.cache.layers[layer].table(self.cache.sequences[0]).holes
            assert sorted(pages.pages.empty) == list(range(self.n_pages)) and not pages.pages.cached
            assert not pages.pages.ref_counts.any()
            assert np.all(pages.positions == -1) and np.all(np.isneginf(pages.bias))
        assert self.cache.take_events() == []

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "cache"):
            return
        ps, max_pages = self.config.page_size, self.n_pages
        for layer, pages in enumerate(self.cache.stores):
            table = self.cache.block_table(0, layer)
            slots = pages.positions.reshape(max_pages, ps)
            occupied = slots >= 0
            resident = slots[occupied]
            assert resident.size <= self.config.capacity
            assert len(np.unique(resident)) == resident.size, "a token sits in two slots"
            assert pages.pages.n_free() + len(table) == max_pages
            assert len(set(table)) == len(table)
            assert not set(table) & (set(pages.pages.empty) | set(pages.pages.cached))
            # one sequence: a page is referenced once exactly when its sequence's block table holds it
            assert np.array_equal(np.flatnonzero(pages.pages.ref_counts), sorted(table))
            assert set(pages.pages.ref_counts.tolist()) <= {0, 1}
            for page in range(max_pages):
                in_table = page in table
                assert occupied[page].sum() == pages.fill[page] <= ps
                assert in_table == (pages.fill[page] > 0), "block table disagrees with the slot map"
            # holes are exactly the empty slots of allocated pages
            expected_holes = {p * ps + s for p in table for s in range(ps) if not occupied[p, s]}
            assert self.cache.layers[layer].table(self.cache.sequences[0]).holes == expected_holes
            if pages.tiered:
                self.tiers_are_consistent(pages, table)
            else:
                assert np.array_equal(np.isfinite(pages.bias), pages.positions >= 0)
                assert pages.high_water == (max(table) + 1 if table else 0)
            # every token that left has an eviction event: replayed events equal the slot map
            replayed = self.replayed[layer]
            assert {p: (int(a), int(b)) for p, (a, b) in replayed.items()} == {
                int(slots[a, b]): (int(a), int(b)) for a, b in zip(*np.nonzero(occupied))}


    @staticmethod
    def tiers_are_consistent(pages, table):
        """Home frames hold exactly the pages that say they are there; a page not in RAM is clean (on
        disk); each RAM slot shows its page's positions and is unmasked exactly where a token is."""
        home = pages.page_in[: pages.home_frames]
        in_home = home[home >= 0]
        assert set(in_home.tolist()) <= set(table)
        assert np.array_equal(np.flatnonzero(pages.tier.home.ref_counts), np.flatnonzero(home >= 0))
        for page in table:
            frame = pages.frame_of[page]
            if frame >= 0:
                assert frame < pages.home_frames and pages.page_in[frame] == page
            else:
                assert not pages.tier.dirty[page], "a page left RAM without being written"
        ps = pages.page_size
        for frame in range(pages.n_frames):
            page = pages.page_in[frame]
            shown = pages.frame_positions[frame * ps: (frame + 1) * ps]
            if page >= 0:
                assert np.array_equal(shown, pages.positions[page * ps: (page + 1) * ps])
            else:
                assert np.all(shown == -1)
            assert np.array_equal(np.isfinite(pages.bias[frame * ps: (frame + 1) * ps]), shown >= 0)
        assert pages.high_water == pages.tier.home.high_water()


PagePoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestPagePool = PagePoolMachine.TestCase

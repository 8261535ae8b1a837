"""The shared pool under random start / step / fork / evict / free / preempt, in RAM and over a disk tier:
reference counts, the free queue, copy-on-write isolation and the LRU order of cached pages."""

import os
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagevis.kvcache import CacheConfig, EventKind, KVCacheManager, eviction

N_LAYERS, N_KV, HEAD_DIM = 2, 1, 2


class SharedPoolMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 4), budget_pages=st.integers(2, 5), pool_pages=st.integers(6, 24),
                policy=st.sampled_from(["oldest", "sinks", "h2o", "oldest-page", "snapkv", "lru", "lfu"]),
                seed=st.integers(0, 1000), ram_frames=st.sampled_from([0, 2, 3, 5]))
    def setup(self, page_size, budget_pages, pool_pages, policy, seed, ram_frames):
        """ram_frames 0: every page in RAM; else a disk tier holds the pool's pages and RAM caches that many."""
        params = {"sinks": {"n_sink": 1}, "snapkv": {"window": 1, "kernel": 1}}.get(policy, {})
        tier = {"max_pages": ram_frames, "disk_pages": budget_pages} if ram_frames else {"max_pages": budget_pages}
        self.swap_dir = tempfile.mkdtemp(prefix="pagevis-test-") if ram_frames else None
        self.config = CacheConfig(page_size=page_size, n_layers=N_LAYERS, n_heads=2 * N_KV, n_kv_heads=N_KV,
                                  head_dim=HEAD_DIM, policy=policy, policy_params=params, swap_dir=self.swap_dir,
                                  **tier)
        self.pool = KVCacheManager(self.config, pool_pages)
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.lru = [self._watch(store.pages) for store in self.pool.stores]

    @staticmethod
    def _watch(blocks):
        """The cached free queue as an LRU list should be: frames in the order their last reference
        was dropped, minus those reused since; and a cached frame is reused only as the oldest one."""
        order: list[int] = []
        release, share, allocate = blocks.release, blocks.share, blocks.allocate

        def watched_release(frame):
            became_free = release(frame)
            if became_free and frame in blocks.frame_hash:
                order.append(frame)
            return became_free

        def watched_share(frame):
            if frame in order:
                order.remove(frame)
            share(frame)

        def watched_allocate():
            had_uncached = len(blocks.empty) > 0
            frame, old_hash = allocate()
            if frame in order:
                assert not had_uncached, "a cached page was reused while an empty frame was free"
                assert order.pop(0) == frame, "a cached page was reused before an older one"
                assert old_hash is not None
            return frame, old_hash

        blocks.release, blocks.share, blocks.allocate = watched_release, watched_share, watched_allocate
        return order

    # --- helpers --------------------------------------------------------------------------------------
    def _write(self, seq_id, token_ids):
        """Append tokens the way a step does, if the pool can take them (else leave the pool unchanged)."""
        if not self.pool.admission.fits(self.pool.admission.pages_needed(seq_id, len(token_ids))):
            return False
        start = len(self.pool.sequences[seq_id].token_ids)
        positions = np.arange(start, start + len(token_ids))
        self.pool.extend(seq_id, token_ids)
        for layer in range(N_LAYERS):
            kv = [self._kv(token_ids, positions, layer, salt) for salt in (0, 1)]
            self.pool.append(seq_id, layer, kv[0], kv[1], positions)
            q = self.rng.standard_normal((len(token_ids), 2 * N_KV, HEAD_DIM)).astype(np.float32)
            self.pool.attend(seq_id, layer, q, positions)
        self.pool.commit(seq_id)
        return True

    @staticmethod
    def _kv(token_ids, positions, layer, salt):
        # K/V a function of (token, position, layer) as in a real model, so cached prefixes are valid
        values = np.asarray(token_ids) * 7.0 + positions * 0.5 + layer * 100 + salt * 1000
        return np.repeat(values[:, None, None], HEAD_DIM, axis=2).astype(np.float32)

    def teardown(self):
        if hasattr(self, "pool"):
            self.pool.close()
            if self.swap_dir:
                assert os.listdir(self.swap_dir) == []  # the swap folder went with the pool
                os.rmdir(self.swap_dir)

    def _page_kv(self, store, page):
        """(K, V) of a page, each (n_kv, page_size, head_dim), wherever it lives: its RAM frame, or the disk."""
        frame = store.frame_of[page]
        if frame >= 0:
            return store.k[:, frame], store.v[:, frame]
        ps = self.config.page_size
        data = os.pread(store.tier.swap.fd, self.config.page_bytes(), page * self.config.page_bytes())
        kv = np.frombuffer(data, dtype=np.float32).reshape(2, N_KV, ps, HEAD_DIM)
        return kv[0], kv[1]

    def _token_kv(self, store, flat):
        """K and V of the given flat slots, (n_kv, len(flat), head_dim) each."""
        ps = self.config.page_size
        pages = [self._page_kv(store, f // ps) for f in flat]
        k = np.stack([kv[0][:, f % ps] for kv, f in zip(pages, flat)], axis=1) if len(flat) else np.zeros((N_KV, 0, HEAD_DIM))
        v = np.stack([kv[1][:, f % ps] for kv, f in zip(pages, flat)], axis=1) if len(flat) else np.zeros((N_KV, 0, HEAD_DIM))
        return k, v

    def _snapshot(self, seq_ids):
        """What each sequence reads: per layer, its resident (position, K, V) in position order."""
        snap = {}
        for seq_id in seq_ids:
            per_layer = []
            for layer, store in enumerate(self.pool.stores):
                flat = self.pool.flat_slots(seq_id, layer)
                pos = store.positions[flat]
                keep = flat[pos >= 0][np.argsort(pos[pos >= 0])]
                k, v = self._token_kv(store, keep)
                per_layer.append((store.positions[keep].tobytes(), k.tobytes(), v.tobytes()))
            snap[seq_id] = per_layer
        return snap

    def _check_hit(self, store, table, flat, expected):
        """The keys a prefix hit brought back (flat slots of the block table's pages) are the tokens'."""
        np.testing.assert_array_equal(self._token_kv(store, flat)[0].transpose(1, 0, 2), expected)

    def _others_unchanged(self, action, acting):
        others = [s for s in self.pool.sequences if s != acting]
        before = self._snapshot(others)
        result = action()
        after = self._snapshot([s for s in others if s in self.pool.sequences])
        for seq_id, state in after.items():
            assert state == before[seq_id], f"sequence {seq_id}'s K/V changed when {acting} acted"
        return result

    # --- rules ----------------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def start(self, tokens):
        seq_id = self.next_id
        self.next_id += 1
        self.pool.add_sequence(seq_id)
        hit = self.pool.match_prefix(seq_id, tokens)
        assert hit % self.config.page_size == 0 and hit < len(tokens)
        for layer, store in enumerate(self.pool.stores):  # a hit brings back exactly the K/V of its tokens
            flat = self.pool.flat_slots(seq_id, layer)[:hit]
            assert store.positions[flat].tolist() == list(range(hit))
            expected = self._kv(tokens[:hit], np.arange(hit), layer, 0)
            self._check_hit(store, self.pool.block_table(seq_id, layer), flat, expected)
        if not self._others_unchanged(lambda: self._write(seq_id, tokens[hit:]), seq_id):
            self.pool.free(seq_id, None)

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data(), n=st.integers(1, 3))
    def step(self, data, n):
        seq_id = data.draw(st.sampled_from(sorted(self.pool.sequences)))
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        self._others_unchanged(lambda: self._write(seq_id, tokens), seq_id)
        for layer in range(N_LAYERS):
            assert self.pool.resident(seq_id, layer) <= self.config.capacity

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.pool.sequences)))
        n = data.draw(st.integers(0, len(self.pool.sequences[parent].token_ids)))
        partial = sum(1 for layer in range(N_LAYERS) for p in self.pool.block_table(parent, layer)
                      if self.pool.stores[layer].fill[p] and not (self.pool.stores[layer].positions[
                          p * self.config.page_size:(p + 1) * self.config.page_size] < n).all())
        if partial > self.pool.admission.n_free():
            return
        child = self.next_id
        self.next_id += 1
        self._others_unchanged(lambda: self.pool.fork(parent, child, n), child)
        for layer, store in enumerate(self.pool.stores):
            flat = self.pool.flat_slots(child, layer)
            parent_flat = self.pool.flat_slots(parent, layer)
            expected = store.positions[parent_flat]
            assert sorted(store.positions[flat][store.positions[flat] >= 0]) == sorted(
                expected[(expected >= 0) & (expected < n)])

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def evict(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.pool.sequences)))
        layer = data.draw(st.integers(0, N_LAYERS - 1))
        seq = self.pool.sequences[seq_id]
        if self.pool.resident(seq_id, layer) < 2 or self.pool.admission.n_free() < 1:
            return
        before = self.pool.resident(seq_id, layer)
        try:
            self._others_unchanged(lambda: eviction.evict(self.pool.layers[layer], seq), seq_id)
        except RuntimeError:  # everything left is protected (sinks, h2o's recent window)
            return
        assert self.pool.resident(seq_id, layer) < before

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        seq_id = data.draw(st.sampled_from(sorted(self.pool.sequences)))
        self._others_unchanged(lambda: self.pool.free(seq_id, EventKind.PREEMPT if preempt else EventKind.FREE), seq_id)

    # --- invariants -----------------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_block_tables(self):
        if not hasattr(self, "pool"):
            return
        for layer, blocks in enumerate(store.pages for store in self.pool.stores):
            expected = np.zeros(self.pool.pool_pages, dtype=np.int32)
            for seq in self.pool.sequences.values():
                table = self.pool.layers[layer].table(seq).pages
                assert len(set(table)) == len(table), "a sequence points at one page twice"
                np.add.at(expected, table, 1)
            assert np.array_equal(blocks.ref_counts, expected)
            free = set(blocks.empty) | set(blocks.cached)
            assert not free & set(np.flatnonzero(expected).tolist()), "a page is both free and referenced"
            assert len(free) + np.count_nonzero(expected) == self.pool.pool_pages
            assert all(blocks.hash_frame[h] == f for f, h in blocks.frame_hash.items())

    @invariant()
    def cached_free_queue_is_lru(self):
        """Cached free pages leave the queue in the order they joined it (oldest release first)."""
        if not hasattr(self, "pool"):
            return
        for blocks, order in zip((store.pages for store in self.pool.stores), self.lru):
            assert blocks.cached_free() == order

    @invariant()
    def pages_hold_whole_prefixes(self):
        """A hashed page in use holds exactly the tokens of a full page (positions i*ps .. (i+1)*ps - 1); a
        free one holds no live token (a prefix hit restores its positions: checked in `start`)."""
        if not hasattr(self, "pool"):
            return
        ps = self.config.page_size
        for store in self.pool.stores:
            blocks = store.pages
            for frame in blocks.frame_hash:
                positions = store.positions[frame * ps:(frame + 1) * ps]
                if blocks.ref_counts[frame]:
                    assert positions[0] % ps == 0 and np.array_equal(positions, positions[0] + np.arange(ps))
                else:
                    assert (positions == -1).all() and store.fill[frame] == 0


SharedPoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestSharedPool = SharedPoolMachine.TestCase

"""A page two sequences share is never changed in place: every path that changes a sequence's tokens (an
eviction, a merge's survivor, re-rotated keys, ThinK's pruned key channels) copies it first, and the shared page
keeps its K/V and its prefix hash (the other sequence and later prefix hits still read it)."""

import dataclasses

import numpy as np
import pytest

from pagevis.kvcache import CacheConfig, EventKind, KVCacheManager, eviction, make_policy

PS, N_KV, HEAD_DIM = 4, 2, 8
PROMPT = list(range(100, 109))  # two full pages and one token: a prefix hit reuses the two pages
CONFIG = CacheConfig(page_size=PS, max_pages=6, n_layers=1, n_heads=4, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                     policy="h2o")


def kv(rng, n):
    return [rng.standard_normal((n, N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2)]


def write(cache, seq_id, tokens, first, rng):
    cache.extend(seq_id, tokens)
    k, v = kv(rng, len(tokens))
    cache.append(seq_id, 0, k, v, np.arange(first, first + len(tokens)))
    cache.commit(seq_id)


def shared_prefix(config, rng):
    """Sequence 0 wrote the prompt (its two full pages registered); sequence 1 (config's policy) reuses them by a
    prefix hit and wrote four tokens of its own. Returns the cache, the shared pages and their hashes."""
    cache = KVCacheManager(config, pool_pages=16)
    cache.add_sequence(0, make_policy(dataclasses.replace(config, policy="none", policy_params={})))
    write(cache, 0, PROMPT, 0, rng)
    cache.add_sequence(1)
    assert cache.match_prefix(1, PROMPT) == 2 * PS
    write(cache, 1, [7, 7, 7, 7], 2 * PS, rng)
    pages = cache.block_table(1)[:2]
    pool = cache.stores[0].pages
    assert all(pool.is_shared(p) for p in pages)
    return cache, pages, [pool.frame_hash[p] for p in pages]


def slot(cache, seq_id, position):
    return int(cache.flat_slots(seq_id, 0)[list(cache.stores[0].positions[cache.flat_slots(seq_id, 0)])
                                           .index(position)])


def evict_from_shared(cache):
    eviction.remove(cache.layers[0], cache.sequences[1], np.array([slot(cache, 1, 2)]), np.zeros(1), "test")


def merge_into_shared(cache):
    victim, survivor = slot(cache, 1, 9), slot(cache, 1, 1)  # a token of its own folds into a shared one
    eviction.merge(cache.layers[0], cache.sequences[1], np.array([victim]), np.zeros(1), np.array([survivor]),
                   np.array([0.5]))


def rerotate_shared(cache):
    # a token of its own leaves: every older survivor (the shared pages' tokens) moves one position later
    eviction.remove(cache.layers[0], cache.sequences[1], np.array([slot(cache, 1, 10)]), np.zeros(1), "test")


def prune_shared_channels(cache):
    q = np.random.default_rng(4).standard_normal((1, 4, HEAD_DIM)).astype(np.float32)
    cache.attend(1, 0, q, np.array([11]))  # the query window ThinK scores the channels by
    cache.commit(1, prompt_done=True)  # ThinK chooses its channels and zeroes the pruned ones in every key


PATHS = {"evict": (evict_from_shared, {"policy": "h2o"}),
         "merge": (merge_into_shared, {"policy": "merge"}),
         "rerotate": (rerotate_shared, {"policy": "h2o", "policy_params": {"rerotate": 1}}),
         "key_channels": (prune_shared_channels, {"policy": "h2o", "key_channels": 0.5})}


@pytest.mark.parametrize("path", PATHS)
def test_a_shared_page_keeps_its_contents_and_its_prefix_hash(path):
    change, settings = PATHS[path]
    cache, pages, hashes = shared_prefix(dataclasses.replace(CONFIG, **settings), np.random.default_rng(3))
    store = cache.stores[0]
    before = [(store.k[:, p].copy(), store.v[:, p].copy(), store.positions[p * PS:(p + 1) * PS].copy())
              for p in pages]
    cache.take_events()
    change(cache)
    events = cache.take_events()
    assert any(e.kind is EventKind.COPY_ON_WRITE for e in events), "the path changed nothing shared"
    assert not [e for e in events if e.kind is EventKind.UNCACHE and e.page in pages]
    for page, page_hash, (k, v, positions) in zip(pages, hashes, before, strict=True):
        assert store.pages.lookup(page_hash) == page  # still a prefix hit for the next sequence
        assert np.array_equal(store.k[:, page], k) and np.array_equal(store.v[:, page], v)
        assert np.array_equal(store.positions[page * PS:(page + 1) * PS], positions)
    assert cache.block_table(0)[:2] == pages  # sequence 0 still reads them
    assert pages[0] not in cache.block_table(1)  # every path changed a token of the first page: its own copy now

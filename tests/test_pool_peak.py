"""KVCacheManager.commit notes its plain layers' pool peaks only when some pool grew since it last noted them
(BlockPool.grown): the same peaks as noting every layer at every commit, through allocations, frees and cached
pages shared back by a prefix hit (which grows a pool without allocating)."""

from __future__ import annotations

import numpy as np

from pagevis.kvcache import CacheConfig, KVCacheManager

PS = 4
CONFIG = CacheConfig(page_size=PS, max_pages=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, policy="none")


def _write(cache: KVCacheManager, seq_id: int, tokens: list[int], first: int) -> None:
    cache.extend(seq_id, tokens)
    k = np.ones((len(tokens), 1, 4), np.float32)
    for layer in range(CONFIG.n_layers):
        cache.append(seq_id, layer, k, k, np.arange(first, first + len(tokens)))


def _peaks(cache: KVCacheManager) -> list[int]:
    return [cache.pool(layer).peak for layer in range(CONFIG.n_layers)]


def test_commits_note_the_peak_a_prefix_hit_raised_without_allocating():
    caches = KVCacheManager(CONFIG, pool_pages=16), KVCacheManager(CONFIG, pool_pages=16)
    caches[1]._committing, caches[1]._peak_stores = list(caches[1].layers), []  # (every layer's own commit)
    prompt = list(range(10, 19))  # two full pages and a token
    seen = []
    for cache in caches:
        cache.add_sequence(0)
        _write(cache, 0, prompt, 0)
        cache.commit(0)
        cache.free(0)  # its full pages stay cached, free
        cache.add_sequence(1)
        _write(cache, 1, list(range(9)), 0)  # three pages: the peak stays 3
        cache.commit(1)
        cache.add_sequence(2)
        assert cache.match_prefix(2, prompt) == 2 * PS  # both pages back in use: the pool grew, nothing allocated
        cache.commit(1)  # (sequence 1's next step commits first)
        seen.append(_peaks(cache))
        _write(cache, 2, prompt[2 * PS:], 2 * PS)
        cache.commit(2)
        seen.append(_peaks(cache))
    assert seen[0] == [5, 5] and seen[:2] == seen[2:], seen

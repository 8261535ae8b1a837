"""The scheduler's questions to the cache (kvcache/admission.py): allocate answers a Reservation or None exactly
as the pool's free pages and a brute-force count of the pages a chunk takes say."""

import numpy as np

from pagevis.kvcache import CacheConfig, KVCacheManager

PS = 4
CONFIG = CacheConfig(page_size=PS, max_pages=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, policy="none")


def test_allocate_is_a_reservation_while_the_pool_holds_the_pages_and_none_after():
    cache = KVCacheManager(CONFIG, pool_pages=6)
    rng = np.random.default_rng(0)
    cache.admission.admit(0, list(range(9)))
    kv = rng.standard_normal((9, 1, 8)).astype(np.float32)
    for layer in range(2):
        cache.append(0, layer, kv, kv, np.arange(9))  # 3 pages of each layer's 6, the last one with 3 free slots
    cache.admission.admit(1, [5, 6])
    for n, pages in ((3, 0), (4, 1), (11, 2), (15, 3)):  # the brute-force count: new pages past the 3 free slots
        held = cache.admission.allocate([(0, n)])
        assert held is not None and held.chunks == ((0, n),)  # 3 free pages a layer: sequence 1's 4 tokens need 1
        assert (cache.admission.allocate([(0, n), (1, 4)]) is not None) == (pages + 1 <= 3)
        exact = cache.admission.allocate([(1, 4)], held)  # on top of what is held: counted exactly, per layer
        assert exact is None if pages + 1 > 3 else exact.pages.tolist() == [pages + 1, pages + 1]
    assert cache.admission.allocate([(0, 16)]) is None  # 4 new pages of a layer that has 3 free
    held = cache.admission.allocate([(0, 11)])
    assert cache.admission.allocate([(1, 5)], held) is None  # 2 + 2 pages > 3
    assert cache.admission.allocate([(1, 4)], held).chunks == ((0, 11), (1, 4))

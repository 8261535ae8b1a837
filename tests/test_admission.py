"""The scheduler's questions to the cache (kvcache/admission.py): allocate answers a Reservation or None exactly
as the pool's free pages and a brute-force count of the pages a chunk takes say."""

import numpy as np
import pytest

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


SETTINGS = [  # every term of layer_pages_needed: writing into shared pages, evicting (at once), kivi key groups,
    # pruning, merging and re-rotating survivors, ThinK's key channels; a pool small enough to preempt
    dict(policy="none", max_pages=12),
    dict(policy="sinks", max_pages=5, policy_params={"n_sink": 2, "compress_every": 3}),
    dict(policy="h2o", max_pages=5, dtype="int4"),
    dict(policy="threshold", max_pages=6, policy_params={"window": 4, "threshold_pct": 60}),
    dict(policy="merge", max_pages=5),
    dict(policy="sinks", max_pages=5, policy_params={"rerotate": 1}, key_channels=0.5),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["none", "sinks-at-once", "h2o-int4", "threshold", "merge",
                                                     "rerotate-think"])
def test_the_cheap_bound_covers_the_exact_count_and_allocate_decides_as_the_exact_count_would(settings):
    """Real scheduling (an Engine: a shared prompt prefix, parallel samples forking their parent's pages, new
    requests joining, preemption in a small pool): at every allocate, each chunk's pages_bound is at least its exact
    per-layer count (pages_needed, a brute count over the block tables), and allocate refuses exactly when the
    exact count of everything asked does not fit."""
    from pagevis.engine import Engine, SamplingConfig, SessionConfig
    from pagevis.engine.batch import BatchConfig
    from pagevis.model.synthetic import SyntheticModel

    model = SyntheticModel(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, seed=3)
    config = SessionConfig(page_size=PS, max_new_tokens=14, chat=False, sampling=SamplingConfig(mode="sample", seed=1),
                           **settings)
    engine = Engine(model, config, BatchConfig(max_seqs=5, pool_pages=24, ignore_eos=True))
    admission, checked = engine.cache.admission, {"bound": 0, "exact": 0}
    allocate = admission.allocate

    def checked_allocate(chunks, held=None):
        chunks = tuple(chunks)
        asked = (held.chunks if held is not None else ()) + chunks
        exact = np.zeros(len(engine.cache.stores), dtype=np.int64)
        for seq_id, n in asked:
            needs = admission.pages_needed(seq_id, n)
            assert admission.pages_bound(seq_id, n) >= max(needs), (seq_id, n, needs)
            exact += needs
        answer = allocate(chunks, held)
        assert (answer is None) == (not admission.fits(exact.tolist()))
        if answer is not None:
            checked["bound" if answer.pages is None else "exact"] += 1
        return answer

    admission.allocate = checked_allocate
    shared = list(b"A shared prompt. ")
    engine.submit_parallel(shared + list(b"Fork me."), 3)
    for round_ in range(4):
        engine.submit(shared + list(f"question {round_}".encode()))
        for _ in range(6):
            if not engine.done:
                engine.step()
    while not engine.done:
        engine.step()
    assert checked["bound"] > 0 and checked["exact"] > 0, checked

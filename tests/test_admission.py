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


# --- the per-step questions' short cuts (room, free_slots, pages_bound; a decode token's chunk) against brute force ---

def brute_room(cache, seq_id):
    """`room` as a count over every layer: its budget less its resident tokens, and a per-head or pruning
    policy's own room there."""
    seq = cache.sequences[seq_id]
    rooms = [layer.budget(seq) - layer.tables[seq_id].resident for layer in cache.layers]
    if seq.policy.per_head:
        rooms += [seq.policy.head_room(layer.view(seq)) for layer in cache.layers]
    if seq.policy.prunes:
        rooms += [seq.policy.prune_room(layer.view(seq)) for layer in cache.layers]
    return min(rooms)


def brute_free_slots(cache, seq_id):
    """Per layer: its holes and the slots of its pool's free pages, and its budget less its resident tokens."""
    seq = cache.sequences[seq_id]
    return min(min(len(layer.tables[seq_id].holes) + layer.store.pages.n_free() * layer.page_size,
                   layer.budget(seq) - layer.tables[seq_id].resident) for layer in cache.layers)


def brute_pages_bound(cache, seq_id, n_tokens):
    new_pages = -(-n_tokens // cache.page_size)
    if len(cache.sequences) == 1:
        return new_pages
    longest = max(len(layer.tables[seq_id].pages) for layer in cache.layers)
    return cache.admission.copy_terms(cache.sequences[seq_id]) * longest + new_pages


def brute_chunk(scheduler, request, left):
    """The scheduler's chunk, every limit asked (a decode token's too)."""
    limits = [request.n_tokens - request.n_cached, scheduler.admission.chunk_limit(request.seq_id)]
    limits += [limit for limit in (scheduler.max_chunk, left) if limit is not None]
    n = max(1, min(limits))
    return request, request.tokens_in(request.n_cached, request.n_cached + n), request.n_cached


FAST_SETTINGS = [  # (model: sliding window, global every; settings): global and local layers, budgets per layer
    # (pyramidkv), a wrapped policy, per-head and pruning rooms, ThinK's channels, and pools small enough that the free pages,
    # not the budget, bound a sequence's free slots (and preempt)
    ((0, 0), dict(policy="none", max_pages=12), 14),
    ((0, 0), dict(policy="none", max_pages=12), 40),
    ((6, 2), dict(policy="none", max_pages=12), 20),
    ((6, 3), dict(policy="sinks", max_pages=4, policy_params={"n_sink": 2}), 24),
    ((0, 0), dict(policy="pyramidkv", max_pages=6, policy_params={"budget": 14, "window": 3, "beta": 4}), 30),
    pytest.param(((0, 0), dict(policy="adakv", max_pages=5), 24), marks=pytest.mark.slow),  # per-head brute force: ~8 s
    ((0, 0), dict(policy="threshold", max_pages=6, policy_params={"window": 4, "threshold_pct": 60}), 24),
    ((0, 0), dict(policy="h2o", max_pages=5, key_channels=0.5), 24),
    ((6, 2), dict(policy="sinks", max_pages=5, policy_params={"n_sink": 2, "compress_every": 3}), 24),  # a wrapper
]


def _random_run(model_windows, settings, pool_pages, seed, brute, on_step=None):
    """An Engine over random requests (a shared prefix, parallel samples, new requests joining at random steps):
    the events, tokens and preemptions of every step. brute: the short cuts replaced by the brute-force counts."""
    from pagevis.engine import Engine, SamplingConfig, SessionConfig
    from pagevis.engine.batch import BatchConfig
    from pagevis.model.synthetic import SyntheticModel

    window, every = model_windows
    model = SyntheticModel(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, seed=seed, sliding_window=window,
                           global_every=every)
    config = SessionConfig(page_size=PS, max_new_tokens=10, chat=False, sampling=SamplingConfig(mode="sample", seed=seed),
                           **settings)
    engine = Engine(model, config, BatchConfig(max_seqs=6, pool_pages=pool_pages, ignore_eos=True))
    if brute:
        cache, scheduler = engine.cache, engine.scheduler
        cache.admission.room = lambda seq_id: brute_room(cache, seq_id)
        cache.admission.free_slots = lambda seq_id: brute_free_slots(cache, seq_id)
        cache.admission.pages_bound = lambda seq_id, n: brute_pages_bound(cache, seq_id, n)
        cache.admission.ensure_rooms = lambda chunks: [cache.admission.ensure_room(s, n) for s, n in chunks]
        scheduler._chunk = lambda request, left: brute_chunk(scheduler, request, left)
    rng, shared, steps = np.random.default_rng(seed), list(b"A shared prompt. "), []
    engine.submit_parallel(shared + list(b"Fork me."), 2)
    for _ in range(60):
        if rng.random() < 0.3:
            tail = rng.integers(97, 123, size=int(rng.integers(1, 14))).tolist()
            engine.submit((shared if rng.random() < 0.5 else []) + tail, max_new_tokens=int(rng.integers(1, 12)))
        if not engine.done:
            engine.step()
            steps.append((tuple(e._replace(score=repr(e.score)) for e in engine.last_events),  # (nan != nan)
                          {s: (list(r.generated), r.stop_reason) for s, r in engine.requests.items()},
                          engine.scheduler.preemptions))
            if on_step is not None:
                on_step(engine)
    return steps


@pytest.mark.parametrize("case", FAST_SETTINGS, ids=["none-small-pool", "none", "none-hybrid", "sinks-hybrid",
                                                     "pyramidkv", "adakv", "threshold", "h2o-think", "sinks-at-once-hybrid"])
def test_the_per_step_short_cuts_decide_as_the_brute_force_counts(case):
    """Over random steps, after every step, each sequence's room, free slots and pages bound are the brute-force
    counts over every layer; and a run with those counts (and a decode token's chunk asking every limit) in
    place of the short cuts makes the same events, tokens and preemptions, step by step."""
    windows, settings, pool_pages = case
    seen = {"pool_bound": 0, "budget_bound": 0}

    def check(engine):
        cache = engine.cache
        for seq_id in cache.sequences:
            free = cache.admission.free_slots(seq_id)
            assert free == brute_free_slots(cache, seq_id), seq_id
            assert cache.admission.room(seq_id) == brute_room(cache, seq_id), seq_id
            for n in (1, 5):
                assert cache.admission.pages_bound(seq_id, n) == brute_pages_bound(cache, seq_id, n)
            seen["pool_bound" if free < brute_room(cache, seq_id) else "budget_bound"] += 1

    for seed in range(2):
        fast = _random_run(windows, settings, pool_pages, seed, brute=False, on_step=check)
        assert fast == _random_run(windows, settings, pool_pages, seed, brute=True)
    assert seen["budget_bound"] > 0 and (pool_pages > 16 or seen["pool_bound"] > 0), seen

"""KVCacheManager.append_many (one call a layer for every decoding sequence) leaves the cache exactly as one
`append` per sequence in the same order does: the same pages, block tables, holes, events and stored K/V bit for
bit (and every policy statistic, and each pool's peak against commits that ask every layer's own `commit`),
through page allocation, a reclaimed cached page, copy-on-write of a shared page, a sliding window's slides, and
sequences that take the one-at-a-time path (an evicting policy at its budget, a per-head policy's masks)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagevis.kvcache import CacheConfig, KVCacheManager, make_policy

PS, N_KV, HEAD_DIM = 4, 2, 8
PROMPT = list(range(100, 109))  # two full pages and one token
CONFIG = CacheConfig(page_size=PS, max_pages=8, n_layers=2, n_heads=4, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                     policy="none", sliding_windows=(None, 6))


def _policy(name: str):
    return make_policy(dataclasses.replace(CONFIG, policy=name, policy_params={}))


def _prefill(cache: KVCacheManager, seq_id: int, tokens: list[int], first: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cache.extend(seq_id, tokens)
    for layer in range(CONFIG.n_layers):
        k, v = (rng.standard_normal((len(tokens), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
        cache.append(seq_id, layer, k, v, np.arange(first, first + len(tokens)))
    cache.commit(seq_id)


def _cache(policies: dict[int, str]) -> KVCacheManager:
    """Sequence 0 wrote PROMPT (its full pages registered) and was freed after a second sequence took them by a
    prefix hit (so they are shared); the others start by a prefix hit, a fork (sharing a partial page) or empty."""
    cache = KVCacheManager(CONFIG, pool_pages=40)
    cache.add_sequence(0, _policy(policies[0]))
    _prefill(cache, 0, PROMPT, 0, seed=1)
    cache.add_sequence(1, _policy(policies[1]))
    assert cache.match_prefix(1, PROMPT) == 2 * PS
    _prefill(cache, 1, PROMPT[2 * PS:] + [5, 6], 2 * PS, seed=2)
    cache.fork(0, 2)  # shares sequence 0's partial third page: its first write copies it
    cache.add_sequence(3, _policy(policies[3]))
    _prefill(cache, 3, [9, 8, 7], 0, seed=3)
    cache.add_sequence(4, _policy(policies[4]))
    _prefill(cache, 4, list(range(200, 228)), 0, seed=4)
    cache.take_events()
    return cache


def _state(cache: KVCacheManager) -> tuple:
    layers = []
    for manager, store in zip(cache.layers, cache.stores, strict=True):
        tables = {s: (list(t.pages), sorted(t.holes), t.resident, t.floor, t.dropped, t.slid,
                      None if t.head_keep is None else t.head_keep.tobytes(),
                      {name: array.tobytes() for name, array in t.state.arrays.items()})
                  for s, t in manager.tables.items()}
        layers.append((tables, store.k.view(np.uint32).tobytes(), store.v.view(np.uint32).tobytes(),
                       store.positions.tobytes(), store.fill.tobytes(), store.bias.tobytes(),
                       store.pages.ref_counts.tobytes(), store.newest, sorted(store.pages.frame_hash.items())))
    newest = {s: seq.newest for s, seq in cache.sequences.items()}
    peaks = [cache.pool(layer).peak for layer in range(CONFIG.n_layers)]
    return layers, newest, peaks, repr(cache.take_events())


def _decode_steps(caches: tuple[KVCacheManager, ...], live: list[int]):
    """The scenario's 14 steps over these caches (the live sequences: 1 to 4, 2 leaving at step 6): each step's
    number set and each live sequence's token extended, then (step, positions) yielded; the caller writes and
    attends, then `_commit`s."""
    for step in range(14):
        if step == 6:  # sequence 2 leaves: its pages go back (cached ones reclaimed later: uncache events)
            for cache in caches:
                cache.free(2)
            live.remove(2)
        positions = np.array([caches[0].n_tokens(s) for s in live], np.int64)
        for cache in caches:
            cache.step = step
            for seq_id in live:
                cache.extend(seq_id, [step])
        yield step, positions


def _commit(caches: tuple[KVCacheManager, ...], live: list[int]) -> None:
    for cache in caches:
        for seq_id in live:
            cache.commit(seq_id)


def _commit_per_layer(cache: KVCacheManager) -> KVCacheManager:
    """The cache, its commits asking every layer's own `commit` in order (KVCacheManager.commit notes a plain
    layer's pool peak itself: this is the rule it shortcuts)."""
    assert cache._peak_stores and cache._committing  # (CONFIG: a global layer and a sliding-window one)
    cache._committing, cache._peak_stores = list(cache.layers), []
    return cache


@pytest.mark.parametrize("policies", [
    {0: "none", 1: "none", 2: "none", 3: "none", 4: "sinks"},  # sequence 4 reaches its budget (32)
    {0: "none", 1: "h2o", 2: "sinks", 3: "adakv", 4: "h2o"},  # evictions at the budget (32), per-head masks
    {0: "none", 1: "keydiff", 2: "merge", 3: "none", 4: "keydiff"},  # statistics written with each token
])
def test_append_many_equals_one_append_per_sequence(policies):
    batched, single = _cache(policies), _commit_per_layer(_cache(policies))
    assert _state(batched) == _state(single)
    rng = np.random.default_rng(7)
    live = [1, 2, 3, 4]
    for step, positions in _decode_steps((batched, single), live):
        for layer in range(CONFIG.n_layers):
            k, v = (rng.standard_normal((len(live), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
            batched.append_many(live, layer, k, v, positions)
            for i, seq_id in enumerate(live):
                single.append(seq_id, layer, k[i: i + 1], v[i: i + 1], positions[i: i + 1])
            assert [batched.n_tokens(s) for s in live] == [single.n_tokens(s) for s in live]  # (newest, each layer)
        _commit((batched, single), live)
        assert _state(batched) == _state(single), f"step {step}"


def test_append_many_covers_the_paths_it_claims(monkeypatch):
    """The scenario above does reach allocation, copy-on-write, slides, reclaimed cached pages and evictions, and
    both of write_many's ways to a slot: inlined (most writes) and through LayerManager.free_slot."""
    from pagevis.kvcache.layer_managers import LayerManager

    cache = _cache({0: "none", 1: "h2o", 2: "sinks", 3: "adakv", 4: "h2o"})
    rng = np.random.default_rng(7)
    live, kinds, writes, slow = [1, 2, 3, 4], set(), 0, []
    free_slot = LayerManager.free_slot
    monkeypatch.setattr(LayerManager, "free_slot", lambda self, *a: slow.append(1) or free_slot(self, *a))
    for step in range(14):
        if step == 6:
            cache.free(2)
            live.remove(2)
        cache.step = step
        positions = np.array([cache.n_tokens(s) for s in live], np.int64)
        for seq_id in live:
            cache.extend(seq_id, [step])
        for layer in range(CONFIG.n_layers):
            k, v = (rng.standard_normal((len(live), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
            cache.append_many(live, layer, k, v, positions)
        for seq_id in live:
            cache.commit(seq_id)
        events = cache.take_events()
        kinds |= {e.kind.value for e in events}
        writes += sum(e.kind.value == "write" for e in events)
    assert {"allocate", "write", "copy_on_write", "slide", "evict", "mask", "release"} <= kinds, kinds
    assert 0 < len(slow) < writes - 20, (len(slow), writes)  # (every write but the inlined ones calls free_slot)


@pytest.mark.parametrize("policies", [
    {0: "none", 1: "none", 2: "none", 3: "none", 4: "sinks"},  # sequence 4 reaches its budget (32)
    {0: "none", 1: "keydiff", 2: "merge", 3: "none", 4: "h2o"},  # statistics written with each token, evictions
])
def test_decode_many_equals_append_many_then_attend_many(policies, monkeypatch):
    """KVCacheManager.decode_many, whose tokens that need only a slot the attention kernel's call writes
    (write_many's `hold`), leaves the cache as append_many then attend_many do, and attends to the same bits; both of
    its ways are taken (every token held, and some through `append` first: then nothing held)."""
    from pagevis.kvcache import kv_cache_manager

    held_then, write_many = [], kv_cache_manager.write_many
    monkeypatch.setattr(kv_cache_manager, "write_many",
                        lambda *a, **kw: held_then.append(write_many(*a, **kw)) or held_then[-1])
    held, written = _cache(policies), _cache(policies)
    rng = np.random.default_rng(5)
    live = [1, 2, 3, 4]
    for step, positions in _decode_steps((held, written), live):
        for layer in range(CONFIG.n_layers):
            k, v = (rng.standard_normal((len(live), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((len(live), CONFIG.n_heads, HEAD_DIM)).astype(np.float32)
            got = held.decode_many(live, layer, q, k, v, positions, range(len(live)))
            assert got is not None
            written.append_many(live, layer, k, v, positions)
            want = written.attend_many(live, layer, q, positions)
            assert np.array_equal(got[0].view(np.uint32), np.concatenate([r.output for r in want]).view(np.uint32))
            for i, result in enumerate(want):
                assert np.array_equal(got[1][i].weights.view(np.uint32), result.weights.view(np.uint32))
                assert np.array_equal(got[1][i].slots, result.slots)
        _commit((held, written), live)
        assert _state(held) == _state(written), f"step {step}"
    assert any(h is None for h in held_then) and any(h is not None for h in held_then)


def test_without_write_events_the_cache_logs_every_other_event_and_changes_the_same():
    """KVCacheManager.record_writes(False): no WRITE event from any way a token is written (append_many's inlined
    path and free_slot's, append's chunks, evictions' rewrites), every other event as with them, in order, and the
    same pages, tables and stored values."""
    policies = {0: "none", 1: "h2o", 2: "sinks", 3: "adakv", 4: "keydiff"}
    logged, quiet = _cache(policies), _cache(policies)
    quiet.record_writes(False)
    rng = np.random.default_rng(3)
    live = [1, 2, 3, 4]
    for step, positions in _decode_steps((logged, quiet), live):
        for layer in range(CONFIG.n_layers):
            k, v = (rng.standard_normal((len(live), N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
            for cache in (logged, quiet):
                if step % 3:
                    cache.append_many(live, layer, k, v, positions)
                else:
                    for i, seq_id in enumerate(live):
                        cache.append(seq_id, layer, k[i: i + 1], v[i: i + 1], positions[i: i + 1])
        _commit((logged, quiet), live)
        events, kept = logged.take_events(), quiet.take_events()
        assert any(e.kind.value == "write" for e in events)
        assert repr(kept) == repr([e for e in events if e.kind.value != "write"]), f"step {step}"
        assert _state(logged)[:-1] == _state(quiet)[:-1], f"step {step}"


def _watched_weights(prompts: list[list[int]], watched: int) -> list[dict[int, dict[int, float]]]:
    """Per decode step of sequence `watched` (submitted index), per layer: its newest query's weight on each
    position (head 0), as the engine keeps them for a watched sequence (Engine.watch_attention)."""
    from pagevis.engine import Engine, SamplingConfig, SessionConfig
    from pagevis.model.synthetic import SyntheticModel

    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, seed=1)
    engine = Engine(model, SessionConfig(page_size=4, max_pages=8, policy="none", max_new_tokens=5, chat=False,
                                         sampling=SamplingConfig(mode="greedy")))
    ids = [engine.submit(prompt) for prompt in prompts]
    engine.watch_attention(ids[watched], (0, 1))
    steps = []
    while not engine.done:
        record = engine.step()
        if any(s.seq_id == ids[watched] and s.kind == "decode" for s in record.seqs):
            steps.append({layer: {int(engine.cache.stores[layer].positions[slot]): float(weight)
                                  for slot, weight in zip(slots if slots is not None else range(len(w[0])), w[0])
                                  if weight > 0}
                          for layer, (w, slots) in engine.attention[ids[watched]].items()})
    return steps


def test_a_watched_sequence_decoding_in_a_batch_keeps_the_weights_it_has_alone():
    """The batched decode step builds an AttentionResult only for watched rows: a watched sequence among others
    gets, per layer and decode step, the weights by position it gets decoding alone (float32 rounding apart)."""
    prompts = [list(b"Pages let many"), list(b"share one pool"), list(b"frames.")]  # one prefill chunk each
    batched, alone = _watched_weights(prompts, 1), _watched_weights(prompts[1:2], 0)
    assert len(batched) == len(alone) == 4  # (the prefill step samples the first of the 5 tokens)
    for step_batched, step_alone in zip(batched, alone, strict=True):
        for layer in (0, 1):
            assert step_batched[layer].keys() == step_alone[layer].keys()
            np.testing.assert_allclose([step_batched[layer][p] for p in step_alone[layer]],
                                       list(step_alone[layer].values()), rtol=1e-5, atol=1e-7)

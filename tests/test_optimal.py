"""compare's clairvoyant `optimal` policy against a brute-force simulation of its definition: at each
eviction, each layer drops the resident token with the least attention still to come (a plain sum over the
later rows of a given attention matrix), ties to the oldest. Shares no code with the engine's pages."""

import numpy as np
import pytest

from pagevis.quality.optimal import FutureAttention
from pagevis.kvcache import CacheConfig, EventKind, KVCacheManager


def brute_force_evictions(attention, capacity):
    """attention: (T, T) rows = queries. Returns the evicted position at each step that evicts."""
    resident, evicted = [], []
    for t in range(len(attention)):
        if len(resident) == capacity:
            future = {j: attention[t:, j].sum() for j in resident}
            victim = min(resident, key=lambda j: (future[j], j))
            resident.remove(victim)
            evicted.append(victim)
        resident.append(t)
    return evicted


@pytest.mark.parametrize("page_size,max_pages", [(1, 5), (4, 3), (3, 4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_evicts_least_future_attention(page_size, max_pages, seed):
    rng = np.random.default_rng(seed)
    n, layers = 40, 2
    # peaked, causal attention rows (float16 values, as the reference stores them), one matrix per layer
    raw = np.tril(rng.exponential(size=(layers, n, n)) ** 3)
    attention = (raw / raw.sum(axis=2, keepdims=True)).astype(np.float16).astype(np.float64)
    policy = FutureAttention(attention.sum(axis=1))
    config = CacheConfig(page_size=page_size, max_pages=max_pages, n_layers=layers, n_heads=1, n_kv_heads=1,
                         head_dim=2, policy="oldest")
    cache = KVCacheManager.single(config)
    policy.bind(config.capacity, page_size)
    cache.sequences[0].policy = policy
    x = np.zeros((1, 1, 2), np.float32)
    for t in range(n):
        cache.step = t
        for layer in range(layers):
            cache.append(0, layer, x, x, np.array([t]))
        policy.consume(attention[:, t, : t + 1])  # query t has run: its attention is no longer to come
    events = cache.take_events()
    for layer in range(layers):
        engine = [e.position for e in events if e.kind is EventKind.EVICT and e.layer == layer]
        assert engine == brute_force_evictions(attention[layer], config.capacity)

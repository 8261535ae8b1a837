"""Each policy's retained set equals a brute-force simulation of its definition, step by step.

The simulation keeps a plain list of resident positions and computes attention itself (float64, via
the dense reference), so it shares no code with the engine's pages, scores or victim selection.
"""

import numpy as np
import pytest

from engine_reference import dense_attention_f64
from pagevis.kvcache import CacheConfig, CacheFullError, ConfigError, EventKind, KVCacheManager

N_KV, GROUP, HEAD_DIM = 2, 2, 8
N_HEADS = N_KV * GROUP
PAGE_LEVEL = ("oldest-page", "lru", "lfu")


class BruteForce:
    """The policies as their papers define them, over a list of resident token positions."""

    def __init__(self, policy, capacity, page_size, params):
        self.policy, self.capacity, self.page_size, self.params = policy, capacity, page_size, params
        self.resident: list[int] = []
        self.accumulated: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.pages: list[list[int]] = []  # page-level policies: tokens grouped by the page they entered
        self.page_last: list[int] = []  # lru/lfu: per page, 2t at a write in step t, 2t + 1 at a use in step t
        self.page_uses: list[int] = []
        self.history: list[dict[int, float]] = []  # snapkv: attention by position, one dict per step
        self.keys: dict[int, np.ndarray] = {}  # keydiff: each token's key (n_kv, d), set by the caller
        self.values: dict[int, np.ndarray] = {}  # expected-attention: each token's value, set by the caller
        self.queries: list[tuple[int, np.ndarray]] = []  # expected-attention: (position, query (heads, d))
        self.step = 0

    def append(self, position):
        if self.policy in PAGE_LEVEL:
            if not self.pages or len(self.pages[-1]) == self.page_size:
                if len(self.pages) == self.capacity // self.page_size:
                    gone = self.page_victim()
                    for token in self.pages.pop(gone):
                        self.resident.remove(token)
                    del self.page_last[gone], self.page_uses[gone]
                self.pages.append([])
                self.page_last.append(0)
                self.page_uses.append(0)
            self.pages[-1].append(position)
            self.page_last[-1] = 2 * self.step
        elif len(self.resident) == self.capacity:
            for victim in self.burst():
                self.resident.remove(victim)
        self.resident.append(position)
        self.accumulated[position] = 0.0

    def burst(self):
        """The tokens a full cache evicts at once: one (a victim), or for expected-attention its compress_every
        (10, or the cache less one if smaller) lowest of one scoring, as kvpress's DecodingPress compresses."""
        if self.policy != "expected-attention":
            return [self.victim()]
        n = self.params.get("compress_every", min(10, self.capacity - 1))
        by_age = sorted(self.resident)
        scores = expected_attention_scores(self, [p for p in by_age if p >= self.params.get("n_sink", 4)], self.step)
        return sorted(scores, key=lambda p: (scores[p], p))[:n]

    def page_victim(self):
        """Index of the page to free; ties go to the page holding the oldest token."""
        if self.policy == "oldest-page":
            return 0
        candidates = range(len(self.pages) - 1) if self.policy == "lfu" else range(len(self.pages))
        value = self.page_last if self.policy == "lru" else self.page_uses
        return min(candidates, key=lambda i: (value[i], min(self.pages[i])))

    def victim(self):
        by_age = sorted(self.resident)
        if self.policy == "oldest":
            return by_age[0]
        if self.policy == "sinks":
            return next(p for p in by_age if p >= self.params.get("n_sink", 4))
        if self.policy == "h2o":
            recent = self.params.get("recent", self.capacity // 2)
            older = by_age[: len(by_age) - recent]
            return min(older, key=lambda p: (self.accumulated[p], p))
        if self.policy == "tova":
            return min(by_age, key=lambda p: (self.last[p], p))
        if self.policy == "snapkv":
            window, kernel = self.params.get("window", 8), self.params.get("kernel", 7)
            seen = [sum(h.get(p, 0.0) for h in self.history[-window:]) for p in by_age]
            half = kernel // 2
            pooled = {p: max(seen[max(0, i - half): i + half + 1]) for i, p in enumerate(by_age)}
            return min(by_age[: len(by_age) - window], key=lambda p: (pooled[p], p))
        if self.policy == "keydiff":  # the anchor over every resident key; the `window` newest kept
            scores = keydiff_scores(self.keys, by_age)
            window = self.params.get("window", min(8, self.capacity // 2))
            return min(by_age[: len(by_age) - window], key=lambda p: (scores[p], p))
        raise AssertionError(self.policy)

    def observe(self, weights_by_position):
        for position, w in weights_by_position.items():
            self.accumulated[position] += w
        self.last = dict(weights_by_position)
        self.history.append(dict(weights_by_position))
        threshold = self.params.get("threshold_pct", 100 * self.page_size / self.capacity) / 100
        for i, page in enumerate(self.pages):
            if sum(weights_by_position[p] for p in page) >= threshold:
                self.page_last[i] = 2 * self.step + 1
                self.page_uses[i] += 1
        self.step += 1


def keydiff_scores(keys, resident):
    """KeyDiff by its definition: per KV head, minus the cosine between a key and the mean of the unit
    keys; the mean over KV heads."""
    stacked = np.stack([keys[p] for p in resident]).astype(np.float64)  # (T, n_kv, d)
    unit = stacked / np.linalg.norm(stacked, axis=-1, keepdims=True)
    anchor = unit.mean(axis=0)  # (n_kv, d)
    cosine = np.einsum("thd,hd->th", unit, anchor) / np.linalg.norm(anchor, axis=-1)
    return dict(zip(resident, -cosine.mean(axis=1)))


def expected_attention_scores(brute, candidates, next_position, rope_base=10000.0):
    """Expected attention by its definition, on complex numbers (a RoPE pair (x[2i], x[2i+1]) is one complex
    number turned by position * base^(-2i/d)): the mean and covariance of the queries before RoPE at
    positions >= n_sink, carried by the rotation averaged over the next n_future positions; per query head
    softmax_k(k·mu/sqrt(d) + kᵀΣk/(2d)) over the candidates, mean over the KV head's group, times ||v||; the
    mean over KV heads."""
    params = brute.params
    n_sink, n_future = params.get("n_sink", 4), params.get("n_future_positions", 512)
    covariance, vnorm = params.get("use_covariance", 1), params.get("use_vnorm", 1)
    d = HEAD_DIM
    turn = rope_base ** (-np.arange(0, d, 2) / d)

    def as_complex(x):
        return x[..., 0::2] + 1j * x[..., 1::2]

    def as_real(z):
        return np.stack([z.real, z.imag], axis=-1).reshape(*z.shape[:-1], d)

    before = [as_real(as_complex(q.astype(np.float64)) * np.exp(-1j * p * turn)) for p, q in brute.queries
              if p >= n_sink]
    queries = np.array(before).reshape(-1, N_HEADS, d)
    mean = queries.mean(axis=0) if len(queries) else np.zeros((N_HEADS, d))
    centred = queries - mean
    cov = np.einsum("nhi,nhj->hij", centred, centred) / max(len(queries), 1)
    rotation = np.zeros((d, d))
    for i, average in enumerate(np.exp(1j * np.outer(np.arange(next_position, next_position + n_future), turn))
                                .mean(axis=0)):
        rotation[2 * i: 2 * i + 2, 2 * i: 2 * i + 2] = [[average.real, -average.imag], [average.imag, average.real]]
    keys = np.stack([brute.keys[p] for p in candidates]).astype(np.float64)  # (T, n_kv, d)
    values = np.stack([brute.values[p] for p in candidates]).astype(np.float64)
    per_kv = np.zeros((len(candidates), N_KV))
    for h in range(N_HEADS):
        kv = h // GROUP
        mu, sigma = rotation @ mean[h], rotation @ cov[h] @ rotation.T
        logits = keys[:, kv] @ mu / np.sqrt(d)
        if covariance:
            logits += np.array([k @ sigma @ k for k in keys[:, kv]]) / (2 * d)
        e = np.exp(logits - logits.max())
        per_kv[:, kv] += e / e.sum() / GROUP
    if vnorm:
        per_kv *= np.linalg.norm(values, axis=-1)
    return dict(zip(candidates, per_kv.mean(axis=1)))


def random_token(rng):
    """One token's K, V (1, N_KV, HEAD_DIM) and query (1, N_HEADS, HEAD_DIM), float32. The queries are
    peaked: some tokens get far more attention than others, as in real models."""
    k = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, N_KV, HEAD_DIM)).astype(np.float32)
    q = (2.5 * rng.standard_normal((1, N_HEADS, HEAD_DIM))).astype(np.float32)
    return k, v, q


def run_both(policy, page_size, max_pages, n_tokens, seed, params=None, ram_frames=None):
    """With ram_frames, the cache has a disk tier of max_pages pages and that many RAM frames: the
    retained set must be the same as with every page in RAM."""
    params = params or {}
    tier = {"max_pages": ram_frames, "disk_pages": max_pages} if ram_frames else {"max_pages": max_pages}
    config = CacheConfig(page_size=page_size, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy=policy, policy_params=params, **tier)
    cache = KVCacheManager.single(config)
    brute = BruteForce(policy, config.capacity, page_size, params)
    rng = np.random.default_rng(seed)
    keys, values = {}, {}
    brute.keys, brute.values = keys, values
    for position in range(n_tokens):
        k, v, q = random_token(rng)
        keys[position], values[position] = k[0], v[0]
        cache.step = position
        cache.append(0, 0, k, v, np.array([position]))
        cache.attend(0, 0, q, np.array([position]))
        brute.append(position)
        _, weights = dense_attention_f64(q[0], np.stack([keys[p] for p in brute.resident]),
                                         np.stack([values[p] for p in brute.resident]))
        brute.observe(dict(zip(brute.resident, weights.mean(axis=0))))
        brute.queries.append((position, q[0]))
        assert sorted(brute.resident) == cache.resident_positions(0, 0).tolist(), f"differs at step {position}"
    return cache


@pytest.mark.parametrize("policy", ["oldest", "sinks", "h2o", "tova", "oldest-page", "snapkv", "lru", "lfu",
                                    "keydiff", "expected-attention"])
@pytest.mark.parametrize("page_size,max_pages", [(1, 12), (4, 3), (8, 4), (5, 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_retained_set_matches_brute_force(policy, page_size, max_pages, seed):
    run_both(policy, page_size, max_pages, n_tokens=4 * page_size * max_pages + 3, seed=seed)


@pytest.mark.parametrize("policy", ["oldest", "sinks", "h2o", "tova", "oldest-page", "keydiff",
                                    "expected-attention"])
@pytest.mark.parametrize("page_size,max_pages,ram_frames", [(1, 7, 2), (4, 3, 2), (5, 5, 3)])
def test_retained_set_with_a_disk_tier_matches_brute_force(policy, page_size, max_pages, ram_frames):
    run_both(policy, page_size, max_pages, n_tokens=4 * page_size * max_pages + 3, seed=2, ram_frames=ram_frames)


@pytest.mark.parametrize("params", [{"n_sink": 0}, {"n_sink": 1}, {"n_sink": 11}])
def test_sinks_parameter(params):
    cache = run_both("sinks", 4, 3, 40, seed=5, params=params)
    kept = cache.resident_positions(0, 0)
    assert kept[: params["n_sink"]].tolist() == list(range(params["n_sink"]))


@pytest.mark.parametrize("params", [{"recent": 0}, {"recent": 3}, {"recent": 11}])
def test_h2o_parameter(params):
    cache = run_both("h2o", 4, 3, 40, seed=6, params=params)
    kept = cache.resident_positions(0, 0).tolist()
    assert kept[len(kept) - params["recent"]:] == list(range(40 - params["recent"], 40))


def test_h2o_keeps_heavy_hitters_that_oldest_drops():
    """A sanity check that the policies differ: h2o keeps some old token a sliding window lost."""
    h2o = set(run_both("h2o", 4, 4, 60, seed=3).resident_positions(0, 0).tolist())
    window = set(run_both("oldest", 4, 4, 60, seed=3).resident_positions(0, 0).tolist())
    assert h2o != window and min(h2o) < min(window)


def test_oldest_page_frees_whole_pages_in_block_table_order():
    cache = run_both("oldest-page", 4, 3, 13, seed=0)
    events = cache.take_events()
    evicted = [e.position for e in events if e.kind is EventKind.EVICT]
    released = [e.page for e in events if e.kind is EventKind.RELEASE]
    assert evicted == [0, 1, 2, 3] and released == [0]
    assert cache.block_table(0, 0) == [1, 2, 0]


def test_random_is_seeded_and_uniformish():
    def evicted(seed):
        config = CacheConfig(page_size=4, max_pages=4, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                             policy="random", policy_params={"seed": seed})
        cache = KVCacheManager.single(config)
        x = np.zeros((1, 1, 2), np.float32)
        for p in range(400):
            cache.append(0, 0, x, x, np.array([p]))
        return [e.position for e in cache.take_events() if e.kind is EventKind.EVICT]

    assert evicted(7) == evicted(7)
    assert evicted(7) != evicted(8)
    # a uniform choice among 16 residents leaves each token about 16 steps on average
    ages = np.arange(16, 400) - np.array(evicted(7))
    assert 10 < ages.mean() < 22
    assert len(set(evicted(7))) == len(evicted(7))


def test_none_refuses_when_full_without_changing_anything():
    config = CacheConfig(page_size=2, max_pages=2, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                         policy="none")
    cache = KVCacheManager.single(config)
    x = np.zeros((1, 1, 2), np.float32)
    for p in range(4):
        cache.append(0, 0, x, x, np.array([p]))
    assert not cache.admission.can_append(0, 1)
    with pytest.raises(CacheFullError, match=r"cache is full.*4 tokens.*2 pages x 2.*policy 'none'"):
        cache.admission.ensure_room(0, 1)
    assert cache.resident_positions(0, 0).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("params", [{"window": 1}, {"window": 5, "kernel": 1}, {"kernel": 3}])
def test_snapkv_parameters(params):
    cache = run_both("snapkv", 4, 3, 40, seed=7, params=params)
    window = params.get("window", 8)
    assert cache.resident_positions(0, 0).tolist()[-window:] == list(range(40 - window, 40))


@pytest.mark.parametrize("window", [0, 3])
def test_keydiff_window(window):
    """window 0: the bare score (kvpress's press); otherwise the newest `window` tokens are never evicted."""
    cache = run_both("keydiff", 4, 3, 40, seed=9, params={"window": window})
    newest = cache.resident_positions(0, 0).tolist()[-window:] if window else []
    assert newest == list(range(40 - window, 40))


@pytest.mark.parametrize("params", [{"threshold_pct": 50}, {"threshold_pct": 1}])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_page_use_threshold(policy, params):
    run_both(policy, 4, 4, 50, seed=8, params=params)


def test_new_policies_keep_different_tokens():
    """The brute-force match means little if the policies coincide: on the same stream they differ."""
    kept = {policy: tuple(run_both(policy, 4, 4, 70, seed=5).resident_positions(0, 0).tolist())
            for policy in ("oldest-page", "lru", "lfu", "snapkv", "h2o", "keydiff")}
    assert len(set(kept.values())) == len(kept), kept


def test_pyramidkv_gives_each_layer_its_own_budget():
    """Layer l keeps at most its budget (falling with depth, mean = budget) and, within it, exactly the
    tokens SnapKV's brute force keeps with that capacity."""
    n_layers, page_size, n_tokens = 3, 4, 60
    params = {"budget": 14, "window": 3, "kernel": 3, "beta": 4}
    config = CacheConfig(page_size=page_size, max_pages=6, n_layers=n_layers, n_heads=N_HEADS, n_kv_heads=N_KV,
                         head_dim=HEAD_DIM, policy="pyramidkv", policy_params=params)
    cache = KVCacheManager.single(config)
    budgets = cache.sequences[0].policy.budgets
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == n_layers
    assert sum(budgets) == n_layers * params["budget"]
    snap = {k: params[k] for k in ("window", "kernel")}
    brutes = [BruteForce("snapkv", budget, page_size, snap) for budget in budgets]
    rng = np.random.default_rng(4)
    keys, values = {}, {}
    for position in range(n_tokens):
        k, v, q = random_token(rng)
        keys[position], values[position] = k[0], v[0]
        cache.step = position
        for layer, brute in enumerate(brutes):
            cache.append(0, layer, k, v, np.array([position]))
            cache.attend(0, layer, q, np.array([position]))
            brute.append(position)
            _, weights = dense_attention_f64(q[0], np.stack([keys[p] for p in brute.resident]),
                                             np.stack([values[p] for p in brute.resident]))
            brute.observe(dict(zip(brute.resident, weights.mean(axis=0))))
            assert sorted(brute.resident) == cache.resident_positions(0, layer).tolist(), (layer, position)
    assert [len(cache.resident_positions(0, layer)) for layer in range(n_layers)] == budgets


def test_pyramidkv_budget_must_fit_the_pool():
    with pytest.raises(ConfigError, match="pyramidkv.budget.*layer 0 needs"):
        CacheConfig(page_size=4, max_pages=4, n_layers=4, policy="pyramidkv", policy_params={"budget": 15})


@pytest.mark.parametrize("policy", ["lru", "lfu", "snapkv", "h2o", "keydiff", "expected-attention"])
def test_a_prefill_chunk_counts_like_its_tokens_one_by_one(policy):
    """The session prefills free slots in one chunk (after a page-level eviction too): the statistics a
    chunk leaves must equal those of its tokens fed one at a time."""
    config = CacheConfig(page_size=4, max_pages=3, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy=policy, policy_params={"window": 3} if policy == "snapkv" else {})
    rng = np.random.default_rng(9)
    k = rng.standard_normal((10, N_KV, HEAD_DIM)).astype(np.float32)
    q = (2.5 * rng.standard_normal((10, N_HEADS, HEAD_DIM))).astype(np.float32)
    chunked, single = KVCacheManager.single(config), KVCacheManager.single(config)
    chunked.append(0, 0, k[:2], k[:2], np.arange(2))
    chunked.attend(0, 0, q[:2], np.arange(2))
    chunked.append(0, 0, k[2:], k[2:], np.arange(2, 10))
    chunked.attend(0, 0, q[2:], np.arange(2, 10))
    for p in range(10):
        single.append(0, 0, k[p:p + 1], k[p:p + 1], np.array([p]))
        single.attend(0, 0, q[p:p + 1], np.array([p]))
    view_c, view_s = chunked.view(0, 0), single.view(0, 0)
    occupied = view_c.occupied()
    assert np.allclose(chunked.sequences[0].policy.score(view_c)[occupied], single.sequences[0].policy.score(view_s)[occupied])


def test_keydiff_reads_keys_not_attention():
    """KeyDiff never needs attention weights: its state is fed the keys as they are written, and a cache
    that never attends evicts exactly as the brute force on keys alone says."""
    config = CacheConfig(page_size=4, max_pages=3, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy="keydiff")
    cache = KVCacheManager.single(config)
    assert not cache.sequences[0].policy.uses_attention
    brute = BruteForce("keydiff", config.capacity, 4, {})
    rng = np.random.default_rng(11)
    for position in range(40):
        k, v, _ = random_token(rng)
        brute.keys[position] = k[0]
        cache.append(0, 0, k, v, np.array([position]))  # no attend call at all
        brute.append(position)
        assert sorted(brute.resident) == cache.resident_positions(0, 0).tolist()


@pytest.mark.parametrize("params", [{"use_covariance": 0}, {"use_vnorm": 0}, {"n_future_positions": 1},
                                    {"n_sink": 0, "n_future_positions": 64}, {"compress_every": 1},
                                    {"compress_every": 3}])
def test_expected_attention_parameters(params):
    run_both("expected-attention", 4, 3, 40, seed=12, params=params)


def test_expected_attention_depends_on_the_queries_and_the_future():
    """Not a disguised sliding window: it keeps old tokens, and what it keeps changes with the queries' model
    (covariance on or off) and with how far ahead it looks."""
    kept = {str(params): tuple(run_both("expected-attention", 4, 4, 60, seed=13, params=params)
                               .resident_positions(0, 0).tolist())
            for params in ({}, {"use_covariance": 0}, {"n_future_positions": 1})}
    assert len(set(kept.values())) == 3, kept
    assert min(kept["{}"][4:]) < 60 - 16


class PerHeadBruteForce:
    """AdaKV by its definition, over one set of kept positions per KV head (SnapKV, TOVA or KeyDiff scores
    per KV head), with attention computed per query head over its KV head's kept tokens."""

    def __init__(self, scorer, capacity, budget, safeguard_pct=20, window=8, kernel=7):
        self.scorer, self.capacity, self.budget = scorer, capacity, budget
        self.n_safe = budget * safeguard_pct // 100
        self.window, self.kernel = window, kernel
        self.kept: list[set[int]] = [set() for _ in range(N_KV)]
        self.history: list[np.ndarray] = []  # per step, (N_KV, positions so far + 1): group-mean attention
        self.keys: dict[int, np.ndarray] = {}

    def resident(self):
        return sorted(set().union(*self.kept))

    def head_scores(self):
        """{(kv, position): score} for every kept entry."""
        tokens = self.resident()
        scores = {}
        for kv in range(N_KV):
            if self.scorer == "keydiff":
                mine = sorted(self.kept[kv])
                if not mine:
                    continue
                unit = np.stack([self.keys[p][kv] / np.linalg.norm(self.keys[p][kv]) for p in mine])
                anchor = unit.mean(axis=0)
                for p, u in zip(mine, unit):
                    scores[kv, p] = -(u @ anchor) / np.linalg.norm(anchor)
                continue
            if self.scorer == "tova":
                last = self.history[-1] if self.history else np.zeros((N_KV, 1))
                for p in self.kept[kv]:
                    scores[kv, p] = last[kv, p] if p < last.shape[1] else 0.0
                continue
            seen = [sum(h[kv, p] for h in self.history[-self.window:] if p < h.shape[1]) for p in tokens]
            half = self.kernel // 2
            for i, p in enumerate(tokens):
                if p in self.kept[kv]:
                    scores[kv, p] = max(seen[max(0, i - half): i + half + 1])
        return scores

    def protected(self):
        return set(self.resident()[-self.window:]) if self.scorer == "snapkv" else set()

    def append(self, position):
        need = sum(map(len, self.kept)) + N_KV - N_KV * self.budget
        if need > 0:
            scores = self.head_scores()
            shielded = self.protected()
            entries = []  # (tier, score, position, head): plain entries go first, then safeguarded, then protected
            for kv in range(N_KV):
                best = sorted(self.kept[kv], key=lambda p: (scores[kv, p], p), reverse=True)[: self.n_safe]
                entries += [(2 if p in shielded else 1 if p in best else 0, scores[kv, p], p, kv)
                            for p in self.kept[kv]]
            for _, _, p, kv in sorted(entries)[:need]:
                self.kept[kv].discard(p)
        if len(self.resident()) == self.capacity:  # no slot: the token whose best head scores lowest goes
            scores = self.head_scores()
            shielded = self.protected()
            best = {p: max(scores[kv, p] for kv in range(N_KV) if p in self.kept[kv]) for p in self.resident()}
            victim = min((p for p in best if p not in shielded), key=lambda p: (best[p], p))
            for kept in self.kept:
                kept.discard(victim)
        for kept in self.kept:
            kept.add(position)

    def attend(self, q, keys, values):
        """Per query head over its KV head's kept tokens; records the group means by position."""
        out = np.zeros((N_HEADS, HEAD_DIM))
        row = np.zeros((N_KV, max(keys) + 1))
        for h in range(N_HEADS):
            kv = h // GROUP
            mine = sorted(self.kept[kv])
            o, w = dense_attention_f64(q[h][None], np.stack([keys[p][kv] for p in mine])[:, None],
                                       np.stack([values[p][kv] for p in mine])[:, None])
            out[h] = o[0]
            row[kv, mine] += w[0] / GROUP
        self.history.append(row)
        return out


def adakv_policy(scorer, budget, safeguard_pct=20):
    from pagevis.kvcache.policies import POLICIES, AdaKV

    inner = POLICIES[scorer](**({"window": 0} if scorer == "keydiff" else {}))  # the brute force's bare score
    return AdaKV(budget=budget, safeguard_pct=safeguard_pct).wrap(inner)


def run_adakv(scorer, page_size, max_pages, budget, n_tokens, seed, safeguard_pct=20, n_seqs=1, ram_frames=None):
    """The cache (holding n_seqs - 1 other sequences too, so that attention gathers through block tables;
    with ram_frames, a disk tier of the pool's pages cached in that many RAM frames) against the per-head
    brute force: each KV head's kept set, and the attention output, every step."""
    pool = {"max_pages": max_pages * n_seqs} if ram_frames is None else {"max_pages": ram_frames,
                                                                         "disk_pages": max_pages * n_seqs}
    config = CacheConfig(page_size=page_size, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy="sinks", **pool)
    cache = KVCacheManager(config)
    for other in range(1, n_seqs):
        cache.add_sequence(other)
        x = np.ones((3, N_KV, HEAD_DIM), np.float32)
        cache.append(other, 0, x, x, np.arange(3))
    policy = adakv_policy(scorer, budget, safeguard_pct)
    policy.bind(max_pages * page_size, page_size)
    policy.bind_layers(1)
    policy.bind_heads(N_HEADS, N_KV, HEAD_DIM, 10000.0)
    cache.add_sequence(0, policy)
    brute = PerHeadBruteForce(scorer, max_pages * page_size, budget, safeguard_pct)
    rng = np.random.default_rng(seed)
    keys, values = brute.keys, {}
    for position in range(n_tokens):
        k, v, q = random_token(rng)
        keys[position], values[position] = k[0], v[0]
        cache.step = position
        cache.append(0, 0, k, v, np.array([position]))
        result = cache.attend(0, 0, q, np.array([position]))
        brute.append(position)
        expected = brute.attend(q[0], keys, values)
        keep = cache.head_keep(0, 0)
        positions = cache.stores[0].positions
        for kv in range(N_KV):
            held = sorted(positions[keep[kv] & (positions >= 0)].tolist())
            assert held == sorted(brute.kept[kv]), f"KV head {kv} differs at step {position}"
        assert cache.resident_positions(0, 0).tolist() == brute.resident()
        assert np.allclose(result.output[0], expected, atol=1e-5)
        assert cache.head_entries(0, 0) == sum(map(len, brute.kept)) <= N_KV * budget
    return cache


@pytest.mark.parametrize("scorer", ["snapkv", "tova", "keydiff"])
@pytest.mark.parametrize("page_size,max_pages,budget", [(1, 16, 12), (4, 4, 12), (4, 6, 12), (5, 4, 14)])
def test_adakv_matches_its_per_head_brute_force(scorer, page_size, max_pages, budget):
    run_adakv(scorer, page_size, max_pages, budget, n_tokens=3 * page_size * max_pages + 5, seed=21)


@pytest.mark.parametrize("scorer,ram_frames,n_seqs", [("snapkv", 2, 1), ("tova", 3, 1), ("snapkv", 3, 2)])
def test_adakv_with_a_disk_tier_matches_its_per_head_brute_force(scorer, ram_frames, n_seqs):
    """The reader applies each KV head's mask to RAM pages and to disk pages read back alike."""
    cache = run_adakv(scorer, 4, 6, 12, 60, seed=28, n_seqs=n_seqs, ram_frames=ram_frames)
    assert cache.stores[0].tier.counts.faults > 0  # pages were read back from disk


@pytest.mark.parametrize("safeguard_pct", [0, 50, 100])
def test_adakv_safeguard(safeguard_pct):
    run_adakv("snapkv", 4, 6, 12, 70, seed=22, safeguard_pct=safeguard_pct)


def test_adakv_gathers_through_block_tables_beside_other_sequences():
    run_adakv("tova", 4, 4, 10, 50, seed=23, n_seqs=2)


def test_adakv_heads_keep_different_tokens_and_slots_free_both_ways():
    """Heads do diverge (else AdaKV would be token eviction); a slot is freed when its last head drops it,
    and, when the pool runs out of slots first, a whole token goes."""
    cache = run_adakv("snapkv", 4, 4, 14, 80, seed=24)
    events = cache.take_events()
    masks = [e for e in events if e.kind is EventKind.MASK]
    evictions = [e for e in events if e.kind is EventKind.EVICT]
    assert {e.detail for e in masks} == set(range(N_KV))
    assert {e.reason for e in evictions} == {"dropped by every KV head", AdaKVReason}
    keep = cache.head_keep(0, 0) & (cache.stores[0].positions >= 0)
    assert (keep[0] != keep[1]).any()


AdaKVReason = "lowest score among all KV heads' entries"


def test_per_head_masks_survive_fork_and_copy_on_write():
    """A forked child reads exactly what its parent read (masks and all), and its writes into the shared
    partial page copy the page without changing the parent's view."""
    cache = run_adakv("tova", 4, 8, 10, 40, seed=25)
    q = (2.5 * np.random.default_rng(26).standard_normal((1, N_HEADS, HEAD_DIM))).astype(np.float32)
    before = cache.attend(0, 0, q, np.array([40])).output
    cache.extend(0, range(40))  # the token ids fork counts (run_adakv writes K/V only)
    cache.fork(0, 1)
    assert cache.head_entries(1, 0) == cache.head_entries(0, 0)
    both = cache.attend(0, 0, q, np.array([40])).output
    child = cache.attend(1, 0, q, np.array([40])).output
    assert np.allclose(before, both) and np.allclose(before, child)
    x = np.zeros((1, N_KV, HEAD_DIM), np.float32)
    cache.append(1, 0, x, x, np.array([40]))
    assert cache.cow_total >= 1
    assert np.allclose(cache.attend(0, 0, q, np.array([40])).output, before)
    assert cache.head_keep(0, 0).shape == (N_KV, cache.stores[0].n_slots)


def test_adakv_over_expected_attention_holds_its_budget():
    config = CacheConfig(page_size=4, max_pages=8, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy="sinks")
    cache = KVCacheManager.single(config)
    cache.free(0)
    policy = adakv_policy("expected-attention", 10)
    policy.bind(32, 4)
    policy.bind_layers(1)
    policy.bind_heads(N_HEADS, N_KV, HEAD_DIM, 10000.0)
    cache.add_sequence(0, policy)
    rng = np.random.default_rng(27)
    for position in range(60):
        k, v, q = random_token(rng)
        cache.append(0, 0, k, v, np.array([position]))
        cache.attend(0, 0, q, np.array([position]))
        assert cache.head_entries(0, 0) <= N_KV * 10
    kept = cache.head_keep(0, 0) & (cache.stores[0].positions >= 0)
    assert all(set(range(4)) <= set(cache.stores[0].positions[kept[kv]].tolist()) for kv in range(N_KV))  # sinks


@pytest.mark.parametrize("disk", [False, True])
def test_per_head_masks_compose_with_quest(disk):
    """Quest reads the pages its key bounds choose (bounds over every key of a page, dropped entries included:
    still an upper bound), and each KV head attends only to the tokens it keeps there: every step's output
    equals dense float64 attention over, per KV head, the read tokens that head keeps."""
    pool = {"max_pages": 3, "disk_pages": 8} if disk else {"max_pages": 8}
    config = CacheConfig(page_size=4, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy="adakv", policy_params={"budget": 12}, select="quest", select_pages=2, **pool)
    cache = KVCacheManager.single(config)
    rng = np.random.default_rng(29)
    keys, values, narrowed = {}, {}, 0
    for position in range(50):
        k, v, q = random_token(rng)
        keys[position], values[position] = k[0].astype(np.float64), v[0].astype(np.float64)
        cache.append(0, 0, k, v, np.array([position]))
        result = cache.attend(0, 0, q, np.array([position]))
        store, keep = cache.stores[0], cache.head_keep(0, 0)
        read = set(store.positions[result.slots].tolist()) - {-1}
        narrowed += len(read) < cache.resident(0, 0)
        for head in range(N_HEADS):
            kv = head // GROUP
            kept = sorted(p for p in read if keep[kv, np.flatnonzero(store.positions == p)[0]])
            expected, _ = dense_attention_f64(q[0][head: head + 1], np.stack([keys[p][kv: kv + 1] for p in kept]),
                                              np.stack([values[p][kv: kv + 1] for p in kept]))
            np.testing.assert_allclose(result.output[0, head], expected[0], atol=1e-5)
        assert cache.head_entries(0, 0) <= N_KV * 12
    assert narrowed > 20  # quest did leave pages unread


def duo_cache(page_size, max_pages, n_layers, scores, ram_frames=None, **params):
    from pagevis.kvcache.policies import DuoAttention

    pool = {"max_pages": max_pages} if ram_frames is None else {"max_pages": ram_frames, "disk_pages": max_pages}
    config = CacheConfig(page_size=page_size, n_layers=n_layers, n_heads=N_HEADS, n_kv_heads=N_KV,
                         head_dim=HEAD_DIM, policy="sinks", **pool)
    cache = KVCacheManager(config)
    policy = DuoAttention(**params).calibrated(scores)
    policy.bind(config.capacity, page_size)
    policy.bind_layers(n_layers)
    policy.bind_heads(N_HEADS, N_KV, HEAD_DIM, 10000.0)
    cache.add_sequence(0, policy)
    return cache, policy


@pytest.mark.parametrize("params", [{}, {"n_sink": 0, "recent": 3}, {"streaming_pct": 75, "recent": 5},
                                    {"streaming_pct": 0}, {"streaming_pct": 100, "recent": 6}])
@pytest.mark.parametrize("page_size,max_pages", [(4, 6), (5, 4)])
def test_duo_matches_its_brute_force(params, page_size, max_pages):
    """Streaming KV heads keep sinks + the recent newest, retrieval heads everything the layer holds (its
    oldest non-sink token leaves every head when it is full): per layer and KV head, and the attention."""
    n_layers, n_tokens = 2, 60
    scores = np.array([[0.5, 0.1], [0.3, 0.9]])  # streaming first: (0, 1), then (1, 0), (0, 0), (1, 1)
    cache, policy = duo_cache(page_size, max_pages, n_layers, scores, **params)
    n_sink, recent = params.get("n_sink", 4), params.get("recent", 28)
    n_streaming = round(4 * params.get("streaming_pct", 50) / 100)
    streaming = {(0, 1), (1, 0), (0, 0), (1, 1)}
    streaming = set(list(((0, 1), (1, 0), (0, 0), (1, 1)))[:n_streaming])
    assert {tuple(x) for x in np.argwhere(policy.streaming)} == streaming
    capacity = page_size * max_pages
    kept = [[set() for _ in range(N_KV)] for _ in range(n_layers)]
    rng = np.random.default_rng(31)
    keys, values = {}, {}
    for position in range(n_tokens):
        k, v, q = random_token(rng)
        keys[position], values[position] = k[0], v[0]
        for layer in range(n_layers):
            heads = kept[layer]
            for kv in range(N_KV):
                if (layer, kv) in streaming:
                    heads[kv] -= {p for p in heads[kv] if n_sink <= p <= position - recent}
            union = set().union(*heads)
            if len(union) == capacity:
                victim = min(p for p in union if p >= n_sink)
                for held in heads:
                    held.discard(victim)
            for held in heads:
                held.add(position)
            cache.append(0, layer, k, v, np.array([position]))
            out = cache.attend(0, layer, q, np.array([position])).output[0]
            keep = cache.head_keep(0, layer) & (cache.stores[layer].positions >= 0)
            for kv in range(N_KV):
                assert sorted(cache.stores[layer].positions[keep[kv]].tolist()) == sorted(heads[kv]), (layer, kv)
                for h in range(kv * GROUP, (kv + 1) * GROUP):
                    mine = sorted(heads[kv])
                    expected, _ = dense_attention_f64(q[0, h][None], np.stack([keys[p][kv] for p in mine])[:, None],
                                                      np.stack([values[p][kv] for p in mine])[:, None])
                    assert np.allclose(out[h], expected[0], atol=1e-5)


def test_duo_budget_gives_retrieval_heads_what_streaming_heads_leave():
    """With a budget, a layer's KV heads together hold n_kv x budget entries: 2 KV heads, one streaming
    (n_sink + recent = 8 entries) leaves the retrieval head 2 x 12 - 8 = 16 tokens; a layer with no streaming
    head holds 12, one with only streaming heads 8."""
    scores = np.array([[0.1, 0.9], [0.5, 0.6], [0.2, 0.3]])  # 50% of 6 = 3 streaming: (0,0), (2,0), (2,1)
    cache, policy = duo_cache(4, 5, 3, scores, n_sink=2, recent=6, budget=12)
    assert policy.budgets == [16, 12, 8]
    rng = np.random.default_rng(32)
    for position in range(50):
        k, v, q = random_token(rng)
        for layer in range(3):
            cache.append(0, layer, k, v, np.array([position]))
            cache.attend(0, layer, q, np.array([position]))
    assert [cache.head_entries(0, layer) for layer in range(3)] == [24, 24, 16]
    assert [cache.resident(0, layer) for layer in range(3)] == [16, 12, 8]
    with pytest.raises(ConfigError, match="duo.budget.*layer 0 needs 22 tokens"):
        duo_cache(4, 5, 3, scores, n_sink=2, recent=6, budget=15)


def test_duo_with_a_disk_tier_keeps_and_attends_as_in_ram():
    """Each layer's head masks and attention with 2 RAM frames caching 5 disk pages equal those in RAM."""
    scores = np.array([[0.1, 0.9], [0.5, 0.6], [0.2, 0.3]])
    caches = [duo_cache(4, 5, 3, scores, ram_frames=frames, n_sink=2, recent=6, budget=12)[0] for frames in (None, 2)]
    rng = np.random.default_rng(33)
    for position in range(50):
        k, v, q = random_token(rng)
        for layer in range(3):
            outputs = []
            for cache in caches:
                cache.append(0, layer, k, v, np.array([position]))
                outputs.append(cache.attend(0, layer, q, np.array([position])).output)
            np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5)
            kept = [{(h, int(p)) for h in range(N_KV) for p in c.stores[layer].positions[
                c.head_keep(0, layer)[h] & (c.stores[layer].positions >= 0)]} for c in caches]
            assert kept[0] == kept[1]
    assert caches[1].stores[0].tier.counts.faults > 0


def test_duo_ships_a_calibration_for_smollm2_only():
    from pagevis.kvcache.policies.duo import shipped_calibration

    shipped = shipped_calibration()
    scores = np.array(shipped["scores"])
    assert scores.shape == (30, 3) and (scores > 0).all()
    config = CacheConfig(page_size=16, max_pages=4, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, policy="duo")
    from pagevis.kvcache import make_policy

    policy = make_policy(config)
    assert policy.streaming.sum() == 45
    assert scores[policy.streaming].max() <= scores[~policy.streaming].min()
    with pytest.raises(ConfigError, match="duo's shipped one is for SmolLM2-135M-Instruct"):
        CacheConfig(page_size=4, max_pages=4, n_layers=2, n_heads=4, n_kv_heads=2, policy="duo")


def test_duo_calibration_measures_what_streaming_changes():
    """scripts/calibrate_duo.py on a small synthetic model: scores are positive relative output errors and
    the lost attention a share, over the queries past n_sink + recent; a wider window loses less."""
    import importlib.util
    from pathlib import Path

    from pagevis.model.synthetic import SyntheticModel

    spec = importlib.util.spec_from_file_location(
        "calibrate_duo", Path(__file__).resolve().parent.parent / "scripts" / "calibrate_duo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = SyntheticModel(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, seed=3)
    ids = np.arange(40) % 200
    short = script.calibrate(model, ids, n_sink=2, recent=4, chunk=16)
    assert short["queries"] == 34 and short["scores"].shape == (2, 2)
    assert (short["scores"] > 0).all() and ((short["lost_attention"] > 0) & (short["lost_attention"] < 1)).all()
    wide = script.calibrate(model, ids, n_sink=2, recent=20, chunk=16)
    assert wide["queries"] == 18 and (wide["lost_attention"] < short["lost_attention"]).all()


def test_layer_capacities_of_duo_follow_the_model_layout():
    """The page grid's per-layer capacities: duo with a budget sizes each layer by its streaming heads; without
    the layout (a trace that does not say) the calibration does not apply and the settings refuse it."""
    from pagevis.engine import SessionConfig
    from pagevis.kvcache import layer_capacities

    settings = SessionConfig(page_size=16, max_pages=8, policy="duo", policy_params={"budget": 64})
    capacities = layer_capacities(settings, 30, 9, 3)
    assert len(capacities) == 30 and max(capacities) == 128 and min(capacities) == 32
    with pytest.raises(ConfigError):
        layer_capacities(settings, 30, 9, 1)


def test_adakv_prefill_chunks_stop_where_its_entries_run_out():
    """The scheduler's room for a per-head policy counts entries: adakv at budget B in a pool of n_kv x B slots
    prefills B tokens in one chunk, then one token at a time (as a token-level policy at B does), so it never
    drops entries mid-chunk on scores that have not seen the chunk."""
    config = CacheConfig(page_size=4, max_pages=8, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HEAD_DIM,
                         policy="adakv", policy_params={"budget": 16})
    cache = KVCacheManager.single(config)
    assert cache.admission.room(0) == 16
    rng = np.random.default_rng(33)
    k, v, q = random_token(rng)
    keys = np.repeat(k, 16, axis=0)
    cache.append(0, 0, keys, keys, np.arange(16))
    assert cache.admission.room(0) == 0 and cache.head_entries(0, 0) == N_KV * 16 and cache.resident(0, 0) == 16

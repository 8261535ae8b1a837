"""Teacher-forced quality of each eviction policy at each cache budget, against the full cache.

A text's tokens are fed through a DecodeSession as its prompt, so the session's own prefill chunking,
eviction and events decide what the bounded cache holds; a thin wrapper around the model keeps the logits
of every token of each chunk (the session only needs the last). The session fills free slots in one chunk
and, once full, feeds one token at a time, so every token is predicted from exactly the cache that a
token-by-token run would have had.

The full-cache reference is computed once per text (not once per configuration): log-probabilities of
every next token and each layer's head-averaged attention. The oracle metrics then follow the definitions
of pagevis.engine.oracle per predicted token: KL(full || bounded), top-1 agreement, and the share of the
full cache's attention on tokens the bounded cache no longer holds (mean over layers and heads).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from pagevis.engine import SessionConfig, steps
from pagevis.engine.teacher_forced import TeacherForced
from pagevis.engine.sampling import log_softmax
from pagevis.kvcache import CacheConfig, CacheFullError, ConfigError, KVCacheManager
from pagevis.kvcache.policies import POLICIES
from pagevis.settings import MAX_PAGES as MAX_POOL_PAGES
from pagevis.kvcache.policies.pyramidkv import PyramidKV, pool_tokens
from pagevis.kvcache.policies.snapkv import SnapKV
from pagevis.quality.optimal import OPTIMAL, FutureAttention


@dataclass(frozen=True)
class PolicyChoice:
    """A policy and its parameters, e.g. parsed from 'sinks:n_sink=0', and the share of key channels ThinK
    prunes (the cache setting key_channels; compare reads it from 'sinks:key_channels=0.5')."""

    name: str
    params: dict = field(default_factory=dict)
    key_channels: float = 0.0

    @property
    def label(self) -> str:
        label = f"{self.name}({','.join(f'{k}={v}' for k, v in self.params.items())})" if self.params else self.name
        return label + (f"+think({self.key_channels:g})" if self.key_channels else "")


class Reference:
    """The full cache on the whole text, per predicted token (the query at position p predicts token p+1).

    Kept in memory: what every row needs at once, O(T) or O(layers x T) — the full cache's log-probability
    of each true next token, its top-1 token, and each layer's total attention per key position (for
    `optimal`). Kept in two temporary files and read back one position at a time: each position's
    log-probabilities over the vocabulary (float32, for KL) and each layer's head-mean attention of query p
    over positions 0..p (float16, a triangle: row p starts at layers * p * (p + 1) / 2 values).
    At 8,192 tokens of SmolLM2 the files hold 1.6 GB and 2.0 GB; memory holds about 2 MB.
    Close it (or use it as a context manager) to free the files' disk space.
    """

    def __init__(self, token_ids: np.ndarray, n_layers: int, vocab_size: int, folder: str | None = None):
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        n = len(self.token_ids)
        self.n_layers, self.vocab_size = n_layers, vocab_size
        self.true_logprobs = np.zeros(n - 1)  # log p_full(true next token)
        self.top1 = np.zeros(n - 1, dtype=np.int64)
        self.attention_totals = np.zeros((n_layers, n))  # sum over all queries of the attention on a position
        self.seconds = 0.0
        # nameless files (unlinked at once where the OS allows): nothing is left behind, even if killed
        self._logprobs = tempfile.TemporaryFile(prefix="pagevis-logprobs-", dir=folder)
        self._attention = tempfile.TemporaryFile(prefix="pagevis-attention-", dir=folder)
        self._written = 0

    def add(self, logprobs: np.ndarray, attention: np.ndarray) -> None:
        """Append the next position's log-probabilities (vocab,) and attention rows (layers, p + 1)."""
        p = self._written
        self.true_logprobs[p] = logprobs[self.token_ids[p + 1]]
        self.top1[p] = int(np.argmax(logprobs))
        self._logprobs.write(logprobs.astype(np.float32).tobytes())
        rows = attention.astype(np.float16)
        self._attention.write(rows.tobytes())
        self.attention_totals[:, : p + 1] += rows  # the stored (float16) values, so future sums are exact
        self._written += 1

    def logprobs(self, p: int) -> np.ndarray:
        """(vocab,) float64 log-softmax of the full cache's logits at position p."""
        return self._read(self._logprobs, p * self.vocab_size * 4, self.vocab_size, np.float32).astype(np.float64)

    def attention(self, p: int) -> np.ndarray:
        """(layers, p + 1) float32: each layer's head-mean attention of query p over positions 0..p."""
        count = self.n_layers * (p + 1)
        rows = self._read(self._attention, self.n_layers * p * (p + 1) // 2 * 2, count, np.float16)
        return rows.reshape(self.n_layers, p + 1).astype(np.float32)

    @staticmethod
    def _read(handle, offset: int, count: int, dtype) -> np.ndarray:
        handle.flush()
        data = os.pread(handle.fileno(), count * np.dtype(dtype).itemsize, offset)
        return np.frombuffer(data, dtype=dtype)

    def perplexity(self, start: int = 0) -> float:
        return perplexity(self.true_logprobs[start:])

    def close(self) -> None:
        for handle in (self._logprobs, self._attention):
            handle.close()

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Row:
    policy: str
    budget: int
    page_size: int
    ppl: float | None  # over every predicted token
    ppl_evicting: float | None  # over the tokens predicted once the cache was full (positions >= budget)
    full_ppl_evicting: float | None  # the full cache's perplexity over those same tokens
    mean_kl: float | None  # per-token means over the tokens predicted once the cache was full
    top1_agreement: float | None
    lost_attention: float | None
    evictions: int
    evicting_tokens: int
    seconds: float
    note: str = ""
    gap_to_optimal: float | None = None  # ppl_evicting / optimal's at the same budget and dtype - 1
    recall: float | None = None  # tiered rows: share of the full cache's attention on the tokens read
    dtype: str = "float32"  # K/V storage of the bounded cache
    kv_bytes_per_token: float | None = None  # all layers, at the budget (quant.storage_summary)
    kv_bytes: int | None = None  # all layers: kv_bytes_per_token x the tokens its pages hold
    kv_bytes_peak_per_token: float | None = None  # measured: what the run's stores held at most, per token
    equal_memory_to: str = ""  # an equal-memory row: the dtype@budget whose K/V bytes it does not exceed
    key_channels: float = 0.0  # ThinK: the share of key channels pruned (kv_bytes_per_token counts the kept ones)
    residual: int | None = None  # int4 / int2: the residual window used (clamped to the budget: quant.py)
    storage_notice: str = ""  # quant.storage_notice: the residual clamped, or bytes beyond float32's and why
    # tokens held, mean over layers and the tokens predicted once the text passed the budget (a threshold
    # policy's size floats under its capacity); kv_bytes_held: that many tokens' K/V bytes, all layers
    mean_resident: float | None = None
    kv_bytes_held: int | None = None
    # a compressing row (kvzip): the first position whose prediction the evicting columns score (its context's
    # length; None: the budget), and optimal's perplexity on those same tokens (what its gap is taken against)
    scored_from: int | None = None
    optimal_ppl_scored: float | None = None
    logprobs: np.ndarray | None = field(default=None, repr=False, compare=False)  # per predicted token; not saved

    def as_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "logprobs"}


def perplexity(logprobs: np.ndarray) -> float | None:
    return float(math.exp(-np.mean(logprobs))) if len(logprobs) else None


def full_reference(model, token_ids, page_size: int = 16, dtype: str = "float32", chunk: int = 128,
                   folder: str | None = None, progress: Callable[[int], None] | None = None) -> Reference:
    """One pass of the text through a cache that never evicts, in chunks of `chunk` tokens, streamed to a
    Reference (temporary files in `folder`, default the system's temporary folder)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    cfg = model.config
    cache = KVCacheManager.single(CacheConfig(
        page_size=page_size, max_pages=math.ceil(n / page_size), n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=dtype, policy="none",
        sliding_windows=cfg.sliding_windows), prefix_caching=False)  # the model's own windows
    reference = Reference(ids, cfg.n_layers, cfg.vocab_size, folder)
    block = np.zeros((cfg.n_layers, min(chunk, n), n), dtype=np.float32)  # this chunk's attention by position
    started = time.perf_counter()

    def attend(layer, q, k, v, positions):
        cache.append(0, layer, k, v, positions)
        result = cache.attend(0, layer, q, positions)
        keys = cache.slot_positions(layer)
        resident = np.flatnonzero(keys >= 0)
        weights = result.weights.mean(axis=1)  # (chunk, slots): mean over heads
        block[layer, : len(positions)][:, keys[resident]] = weights[:, resident]
        return result.output

    try:
        for start in range(0, n, chunk):
            positions = np.arange(start, min(start + chunk, n), dtype=np.int64)
            logits = model.forward(ids[positions], positions, attend, all_logits=True)
            for i, p in enumerate(positions):
                if p < n - 1:
                    reference.add(log_softmax(logits[i]), block[:, i, : p + 1])
            cache.take_events()
            if progress:
                progress(int(positions[-1]) + 1)
    except BaseException:
        reference.close()
        raise
    reference.seconds = time.perf_counter() - started
    return reference


def _bounded_session(model, reference: Reference, choice: PolicyChoice, budget: int, page_size: int, dtype: str,
                     residual: int | None, piece: int):
    """The teacher-forced session that reads the reference's text through the row's cache, the policy
    parameters the settings got, and `optimal`'s policy (None for every other row)."""
    n = len(reference.token_ids)
    optimal = FutureAttention(reference.attention_totals.copy()) if choice.name == OPTIMAL else None
    tier = tier_settings(choice, budget, page_size, n)
    if tier is not None:
        max_pages, params = budget // page_size, {}
    else:
        max_pages, params = session_pages(choice, budget, page_size, model.config, n)
        tier = {"policy": "oldest" if optimal else choice.name}
    storage = {"dtype": dtype} if residual is None else {"dtype": dtype, "residual": residual}
    config = SessionConfig(page_size=page_size, max_pages=max_pages, policy_params=params, max_new_tokens=1,
                           oracle=False, chat=False, record_layers=(), key_channels=choice.key_channels, **storage,
                           **tier)
    if optimal:  # the session builds policies by name; this one needs the future
        optimal.bind(config.capacity, page_size)
    return TeacherForced(model, reference.token_ids, config, policy=optimal, piece=piece), params, optimal


class Scores(NamedTuple):
    """Per predicted token p (the query at p predicting token p + 1) of a bounded cache against the reference."""

    logprobs: np.ndarray  # log p_bounded(true next token)
    kl: np.ndarray  # KL(full || bounded)
    agree: np.ndarray  # bool: the same top-1 token
    lost: np.ndarray  # share of the full cache's attention on tokens the bounded cache did not read
    held: np.ndarray  # tokens resident per predicted token, mean over layers
    evictions: int


def score(forced: TeacherForced, reference: Reference, optimal: FutureAttention | None = None,
          progress: Callable[[int], None] | None = None) -> Scores:
    """Step the teacher-forced session through the reference's text and score every predicted token against
    the full cache (CacheFullError when a cache that never evicts cannot hold the text)."""
    n = len(reference.token_ids)
    scores = Scores(np.zeros(n - 1), np.zeros(n - 1), np.zeros(n - 1, dtype=bool), np.zeros(n - 1),
                    np.zeros(n - 1), 0)
    evictions = 0
    session = forced.session
    for step in steps(forced):
        record = step.record
        session.records[-1] = None  # read once here; keeps the step count, not the arrays (8k steps)
        evictions = record.evictions_total
        resident = _read_by_layer(session, record, n)  # what this step's queries attended to
        for row, p, nll in zip(step.logits, step.positions, step.nll):
            bounded = log_softmax(row)
            full = reference.logprobs(p)
            scores.logprobs[p] = -nll
            scores.kl[p] = float(np.sum(np.exp(full) * (full - bounded)))
            scores.agree[p] = reference.top1[p] == np.argmax(bounded)
            attention = reference.attention(p)
            gone = ~resident[:, : p + 1]
            scores.lost[p] = float(np.mean(np.sum(attention * gone, axis=1, dtype=np.float64)))
            scores.held[p] = resident[:, : p + 1].sum() / len(resident)  # what query p could read (causal)
            if optimal:
                optimal.consume(attention)
        if progress:
            progress(record.positions[-1] + 1)
    return scores._replace(evictions=evictions)


def evaluate(model, reference: Reference, choice: PolicyChoice, budget: int, page_size: int,
             dtype: str = "float32", progress: Callable[[int], None] | None = None, piece: int = 256,
             residual: int | None = None, equal_memory_to: str = "") -> Row:
    """Teacher-force the reference's text through a bounded cache and compare with the full cache.
    `optimal` (compare only) is the clairvoyant policy of pagevis.quality.optimal, fed the reference's future."""
    n = len(reference.token_ids)
    forced, params, optimal = _bounded_session(model, reference, choice, budget, page_size, dtype, residual, piece)
    session = forced.session
    started = time.perf_counter()
    note = ""
    try:
        true_lp, kl, agree, lost, held, evictions = score(forced, reference, optimal, progress)
    except CacheFullError:
        note = "cache full (policy none never evicts)"
        return Row(choice.label, budget, page_size, None, None, None, None, None, None, 0, 0,
                   time.perf_counter() - started, note, dtype=dtype, equal_memory_to=equal_memory_to)
    scored_from = params.get("context") if getattr(POLICIES.get(choice.name), "compresses", False) else None
    tail = slice(min(budget if scored_from is None else scored_from, n - 1), n - 1)
    evicting = n - 1 - tail.start
    if scored_from is not None:
        note = (f"context: the first {scored_from} tokens prefilled whole, compressed to {budget}; ppl evict and the "
                f"gap over positions >= {scored_from}")
    per_head = optimal is None and getattr(POLICIES.get(choice.name), "per_head", False)
    if per_head:  # the reference keeps head means: what each head dropped cannot be weighed against it
        note = "; ".join(filter(None, [note, "lost attn not measured for a per-head policy"]))
    memory = session.cache.storage()
    return Row(
        policy=choice.label, budget=budget, page_size=page_size, ppl=perplexity(true_lp),
        ppl_evicting=perplexity(true_lp[tail]), full_ppl_evicting=reference.perplexity(tail.start),
        mean_kl=float(np.mean(kl[tail])) if evicting else 0.0,
        top1_agreement=float(np.mean(agree[tail])) if evicting else 1.0,
        lost_attention=None if per_head else float(np.mean(lost[tail])) if evicting else 0.0,
        evictions=evictions, evicting_tokens=evicting, seconds=time.perf_counter() - started, note=note,
        recall=1 - float(np.mean(lost[tail])) if evicting and session.cache_config.tiered else None, dtype=dtype,
        kv_bytes_per_token=memory["kv_bytes_per_token"],
        kv_bytes=round(memory["kv_bytes_per_token"] * (session.cache_config.capacity if scored_from is None
                                                        else budget)),
        kv_bytes_peak_per_token=memory["kv_bytes_peak_per_token"], equal_memory_to=equal_memory_to,
        key_channels=choice.key_channels,
        residual=memory.get("residual"), storage_notice=memory.get("storage_notice", ""),
        mean_resident=float(np.mean(held[tail])) if evicting else None,
        kv_bytes_held=round(float(np.mean(held[tail])) * memory["kv_bytes_per_token"]) if evicting else None,
        scored_from=scored_from, logprobs=true_lp)


TIER_ROWS = ("quest", "disk")  # compare rows with a disk tier: quest's page selection, or exact reads of all


def tier_settings(choice: PolicyChoice, budget: int, page_size: int, n_tokens: int) -> dict | None:
    """The cache settings of a tiered row: `budget` tokens of RAM frames, a disk tier holding the whole
    text (or disk_pages=N, evicting by sinks beyond), and for quest budget / page_size pages read per
    step (or select_pages=K) — the same number of tokens attended as an eviction policy's budget."""
    if choice.name not in TIER_ROWS:
        return None
    params = dict(choice.params)
    disk = int(params.pop("disk_pages", -(-n_tokens // page_size)))
    settings = {"disk_pages": disk, "policy": "none" if disk * page_size >= n_tokens else "sinks",
                "select": "quest" if choice.name == "quest" else "all"}
    if choice.name == "quest":
        settings["select_pages"] = int(params.pop("select_pages", budget // page_size))
    if params:
        raise ConfigError(f"{choice.name}.{next(iter(params))}", params[next(iter(params))],
                          "disk_pages" + (" or select_pages" if choice.name == "quest" else ""))
    return settings


def _read_by_layer(session, record, n: int) -> np.ndarray:
    """(n_layers, n) bool: positions each layer's queries read at this step (its resident tokens, or
    with a page selection the tokens of the pages it read). Read from the live cache, just after the step."""
    if record.tiers is None:
        return _resident_by_layer(record.slot_maps, n)
    mask = np.zeros((len(session.read_slots), n), dtype=bool)
    for layer, slots in enumerate(session.read_slots):
        positions = session.cache.frames(layer).positions
        read = positions if slots is None else positions[slots]
        mask[layer, read[(read >= 0) & (read < n)]] = True
    return mask


def session_pages(choice: PolicyChoice, budget: int, page_size: int, model_config=None,
                  n_tokens: int | None = None) -> tuple[int, dict]:
    """Pages per layer and policy parameters for a row at `budget` tokens per layer. pyramidkv's budget is
    a mean over layers: its pool holds the first (largest) layer's share. A per-head policy (adakv, duo) with a
    model holds n_kv_heads x budget (KV head, token) entries per layer, the K/V of `budget` whole tokens: its
    pool holds the slots its heads' tokens may spread over. A compressing policy (kvzip) prefills a context
    (`context`, default the text's first n_tokens - budget tokens, whole pages), compresses it to `budget`, then
    takes the rest one token at a time: its pool holds the context."""
    params = dict(choice.params)
    cls = POLICIES.get(choice.name)
    if cls is not None and cls.compresses and n_tokens is not None:
        params.setdefault("budget", budget)
        params.setdefault("context", max(budget, (n_tokens - budget) // page_size * page_size))
        return math.ceil(params["context"] / page_size), params
    if cls is not None and cls.per_head and model_config is not None:
        params.setdefault("budget", budget)
        policy = cls(**params)
        policy.bind(MAX_POOL_PAGES * page_size, page_size)
        policy.bind_layers(model_config.n_layers)
        policy.bind_heads(model_config.n_heads, model_config.n_kv_heads, model_config.head_dim,
                          float(model_config.rope_base))
        return math.ceil(policy.pool_tokens() / page_size), params
    if choice.name != PyramidKV.name:
        return budget // page_size, params
    params.setdefault("budget", budget)
    first = pool_tokens(params["budget"], params.get("window", SnapKV.window), params.get("beta", PyramidKV.beta))
    return math.ceil(first / page_size), params


def _resident_by_layer(slot_maps: np.ndarray, n: int) -> np.ndarray:
    """(n_layers, n) bool: positions each layer's cache holds."""
    n_layers = slot_maps.shape[0]
    flat = slot_maps.reshape(n_layers, -1)
    mask = np.zeros((n_layers, n), dtype=bool)
    layer, slot = np.nonzero((flat >= 0) & (flat < n))
    mask[layer, flat[layer, slot]] = True
    return mask


def full_row(reference: Reference, page_size: int) -> Row:
    n = len(reference.token_ids)
    return Row("full cache", n, page_size, reference.perplexity(), None, None, 0.0, 1.0, 0.0, 0, 0,
               reference.seconds)


def fill_gaps(rows: list[Row]) -> None:
    """Set each row's gap to the `optimal` row of its budget and dtype (when there is one and both have a
    perplexity)."""
    best = {(r.budget, r.dtype): r for r in rows if r.policy == OPTIMAL and r.ppl_evicting}
    for r in rows:
        optimal = best.get((r.budget, r.dtype))
        if r.ppl_evicting is None or optimal is None:
            continue
        if r.scored_from is not None:  # a compressing row scores other tokens: optimal's ppl on the same ones
            r.optimal_ppl_scored = perplexity(optimal.logprobs[r.scored_from:])
        r.gap_to_optimal = r.ppl_evicting / (r.optimal_ppl_scored or optimal.ppl_evicting) - 1


def cache_bytes(dtype: str, budget: int, page_size: int, residual: int, model_config) -> int:
    """K/V bytes, all layers, of one sequence's cache of `budget` tokens (CacheConfig.kv_bytes_per_token)."""
    config = CacheConfig(page_size=page_size, max_pages=budget // page_size, dtype=dtype, residual=residual,
                         policy="oldest", n_layers=model_config.n_layers, n_heads=model_config.n_heads,
                         n_kv_heads=model_config.n_kv_heads, head_dim=model_config.head_dim)
    return round(config.kv_bytes_per_token() * config.capacity)


def equal_memory_budget(dtype: str, bytes_allowed: int, page_size: int, residual: int, model_config,
                        most: int) -> int:
    """The largest budget (a multiple of page_size, at most `most`) whose cache in `dtype` takes at most
    bytes_allowed; 0 if not even one page fits."""
    budget = 0
    while budget + page_size <= most and cache_bytes(dtype, budget + page_size, page_size, residual,
                                                      model_config) <= bytes_allowed:
        budget += page_size
    return budget


class Estimate(NamedTuple):
    reference: float
    total: float
    disk_bytes: int


def estimate_seconds(model, n_tokens: int, budgets: list[int], probe: int = 32) -> Estimate:
    """How long compare will take, from one timed prefill chunk and two one-token steps of this model.

    A configuration prefills its budget, then steps one token at a time; the reference prefills everything,
    and its attention grows with the position (flop count relative to the weights' 2 flops per parameter).
    """
    from pagevis.model import DenseAttention

    cfg = model.config
    attention = DenseAttention(cfg)
    ids = np.zeros(probe, dtype=np.int64)
    started = time.perf_counter()
    model.forward(ids, np.arange(probe), attention)
    per_prefill_token = (time.perf_counter() - started) / probe
    started = time.perf_counter()
    for p in (probe, probe + 1):
        model.forward(ids[:1], np.array([p]), attention)
    per_step = (time.perf_counter() - started) / 2
    params = model.weights.nbytes_per_token() / 4
    attention_share = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim / (2 * params)  # per key, vs the weights
    reference = n_tokens * per_prefill_token * (1 + attention_share * n_tokens / 2)
    configs = sum(min(b, n_tokens) * per_prefill_token + max(n_tokens - b, 0) * per_step * 1.2 for b in budgets)
    disk = (n_tokens - 1) * cfg.vocab_size * 4 + cfg.n_layers * (n_tokens - 1) * n_tokens
    return Estimate(reference, reference + configs, disk)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB; macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024

"""Teacher-forced quality of each eviction policy at each cache budget, against the full cache.

A text's tokens are fed through a DecodeSession as its prompt, so the session's own prefill chunking,
eviction and events decide what the bounded cache holds; a thin wrapper around the model keeps the logits
of every token of each chunk (the session only needs the last). The session fills free slots in one chunk
and, once full, feeds one token at a time, so every token is predicted from exactly the cache that a
token-by-token run would have had.

The full-cache reference is computed once per text (not once per configuration): log-probabilities of
every next token and each layer's head-averaged attention. The oracle metrics then follow the definitions
of pagevis.decoding.oracle per predicted token: KL(full || bounded), top-1 agreement, and the share of the
full cache's attention on tokens the bounded cache no longer holds (mean over layers and heads).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..decoding import DecodeSession, SessionConfig
from ..decoding.sampling import log_softmax
from ..engine import CacheConfig, CacheFullError, PagedKVCache


@dataclass(frozen=True)
class PolicyChoice:
    """A policy and its parameters, e.g. parsed from 'sinks:n_sink=0'."""

    name: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}({','.join(f'{k}={v}' for k, v in self.params.items())})"


@dataclass
class Reference:
    """The full cache on the whole text: per predicted token (position p predicts token p+1)."""

    token_ids: np.ndarray  # (T,)
    logprobs: np.ndarray  # (T-1, vocab) float32 log-softmax of the full cache's next-token logits
    attention: np.ndarray  # (n_layers, T-1, T) float16, head-mean attention of query p over positions
    seconds: float

    @property
    def true_logprobs(self) -> np.ndarray:
        """(T-1,) log p_full(true next token)."""
        return self.logprobs[np.arange(len(self.logprobs)), self.token_ids[1:]].astype(np.float64)

    def perplexity(self, start: int = 0) -> float:
        return perplexity(self.true_logprobs[start:])


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

    def as_dict(self) -> dict:
        return asdict(self)


def perplexity(logprobs: np.ndarray) -> float | None:
    return float(math.exp(-np.mean(logprobs))) if len(logprobs) else None


def full_reference(model, token_ids, page_size: int = 16, dtype: str = "float32", chunk: int = 256) -> Reference:
    """One pass of the text through a cache that never evicts, in chunks of `chunk` tokens."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    cfg = model.config
    cache = PagedKVCache(CacheConfig(page_size=page_size, max_pages=math.ceil(n / page_size), n_layers=cfg.n_layers,
                                     n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                     dtype=dtype, policy="none"))
    attention = np.zeros((cfg.n_layers, n - 1, n), dtype=np.float16)
    logprobs = np.zeros((n - 1, cfg.vocab_size), dtype=np.float32)
    started = time.perf_counter()

    def attend(layer, q, k, v, positions):
        cache.append(layer, k, v, positions)
        result = cache.attend(layer, q, positions)
        keys = cache.slot_positions(layer)
        resident = keys >= 0
        rows = positions < n - 1
        weights = result.weights[rows].mean(axis=1)  # (chunk, slots): mean over heads
        attention[layer, positions[rows][:, None], keys[resident][None, :]] = weights[:, resident]
        return result.output

    for start in range(0, n, chunk):
        positions = np.arange(start, min(start + chunk, n), dtype=np.int64)
        logits = model.forward(ids[positions], positions, attend, all_logits=True)
        for i, p in enumerate(positions):
            if p < n - 1:
                logprobs[p] = log_softmax(logits[i])
        cache.take_events()
    return Reference(ids, logprobs, attention, time.perf_counter() - started)


class _KeepAllLogits:
    """The model as a DecodeSession sees it, keeping the logits of every token of the last forward."""

    def __init__(self, model):
        self.model, self.config, self.tokenizer = model, model.config, model.tokenizer
        self.logits: np.ndarray | None = None

    def forward(self, token_ids, positions, attend, all_logits=False):
        self.logits = np.atleast_2d(self.model.forward(token_ids, positions, attend, all_logits=True))
        return self.logits if all_logits else self.logits[-1]


def evaluate(model, reference: Reference, choice: PolicyChoice, budget: int, page_size: int,
             dtype: str = "float32", progress: Callable[[int], None] | None = None) -> Row:
    """Teacher-force the reference's text through a bounded cache and compare with the full cache."""
    ids = reference.token_ids
    n = len(ids)
    config = SessionConfig(page_size=page_size, max_pages=budget // page_size, dtype=dtype, policy=choice.name,
                           policy_params=choice.params, max_new_tokens=1, oracle=False, chat=False,
                           record_layers=())
    wrapped = _KeepAllLogits(model)
    session = DecodeSession(wrapped, "", config, prompt_ids=[int(t) for t in ids])
    true_lp = np.zeros(n - 1)
    kl = np.zeros(n - 1)
    agree = np.zeros(n - 1, dtype=bool)
    lost = np.zeros(n - 1)
    started = time.perf_counter()
    note = ""
    evictions = 0
    try:
        while not session.done:
            record = session.step()
            evictions = record.evictions_total
            resident = _resident_by_layer(record.slot_maps, n)  # what this step's queries attended to
            for i, p in enumerate(record.positions):
                if p >= n - 1:
                    continue
                bounded = log_softmax(wrapped.logits[i])
                full = reference.logprobs[p].astype(np.float64)
                true_lp[p] = bounded[ids[p + 1]]
                kl[p] = float(np.sum(np.exp(full) * (full - bounded)))
                agree[p] = np.argmax(full) == np.argmax(bounded)
                gone = ~resident[:, : p + 1]
                lost[p] = float(np.mean(np.sum(reference.attention[:, p, : p + 1] * gone, axis=1, dtype=np.float64)))
            if progress:
                progress(record.positions[-1] + 1)
    except CacheFullError:
        note = "cache full (policy none never evicts)"
        return Row(choice.label, budget, page_size, None, None, None, None, None, None, 0, 0,
                   time.perf_counter() - started, note)
    tail = slice(min(budget, n - 1), n - 1)
    evicting = n - 1 - tail.start
    return Row(
        policy=choice.label, budget=budget, page_size=page_size, ppl=perplexity(true_lp),
        ppl_evicting=perplexity(true_lp[tail]), full_ppl_evicting=reference.perplexity(tail.start),
        mean_kl=float(np.mean(kl[tail])) if evicting else 0.0,
        top1_agreement=float(np.mean(agree[tail])) if evicting else 1.0,
        lost_attention=float(np.mean(lost[tail])) if evicting else 0.0,
        evictions=evictions, evicting_tokens=evicting, seconds=time.perf_counter() - started, note=note)


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

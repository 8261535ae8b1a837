"""Many sequences decoded together over one shared pool: continuous batching, parallel sampling, fork,
prefix caching and preemption.

Each `step()` runs every running sequence's next tokens (a prefill chunk or one decode token) through
the model in ONE forward call: the weight matmuls take all rows at once and attention runs per sequence
over its own block tables (SharedKVPool.attend). Sequences join between steps when the pool has room and
leave when they finish (their pages stay in the pool's prefix cache until the frames are needed).

When the pool cannot hold the next step, the most recently started sequence is preempted (vLLM v1's
choice): its pages are freed and it goes back to the head of the waiting queue; when it is admitted again
its tokens are recomputed (a prefill of prompt + generated text, much of it found in the prefix cache).
A `preempt` event says so. Sampling is per sequence with its own seeded generator, so a sequence decodes
the same tokens whether it runs alone, in a batch, forked or preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..engine import CacheFullError, ConfigError
from ..engine.pool import PoolEvent, SharedKVPool
from .. import settings
from ..errors import check_int
from ..settings import field_for
from .sampling import Sampler, SamplingConfig
from .session import SessionConfig, decode_ids, encode_prompt

MAX_SEQUENCES = settings.MAX_SEQUENCES
MAX_CHUNK = 512  # prompt tokens one sequence feeds per step (bounds a step's activations)


@dataclass(frozen=True)
class BatchConfig:
    """Many sequences over one pool; defaults, bounds and help in the settings table (pagevis/settings.py)."""

    pool_pages: int | None = field_for("pool_pages")  # frames per layer; None: max_seqs sequences' worth
    max_seqs: int = field_for("max_seqs")  # sequences running in one step
    prefix_caching: bool = field_for("prefix_caching")
    ignore_eos: bool = field_for("ignore_eos")  # decode max_new_tokens whatever is sampled (fixed-shape benches)

    def __post_init__(self) -> None:
        settings.check(self, ("max_seqs", "pool_pages"))


@dataclass
class SeqState:
    seq_id: int
    prompt_ids: tuple[int, ...]
    sampler: Sampler
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    n_cached: int = 0  # tokens whose K/V are in the pool
    started: int = -1  # admission order (preemption takes the highest)
    stop_reason: str | None = None
    preemptions: int = 0
    children: list[int] = field(default_factory=list)  # parallel samples waiting for this one's prefill

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.generated]


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    kind: str  # "prefill" or "decode"
    n_tokens: int
    next_token: int  # -1 when this step did not end the sequence's known tokens


@dataclass(frozen=True)
class BatchRecord:
    """One batched step, with the pool as the sequences view shows it (layer 0)."""

    step: int
    seqs: tuple[SeqStep, ...]
    events: tuple[PoolEvent, ...]
    block_tables: dict[int, tuple[int, ...]]  # live sequence -> its layer-0 pages in logical order
    ref_counts: np.ndarray  # (pool_pages,) int32
    fill: np.ndarray  # (pool_pages,) tokens per page
    cached_free: tuple[int, ...]  # free pages still holding a cached prefix, next reused first
    pages_used: int
    pages_unshared: int  # what the live sequences would hold without sharing
    contiguous_reserved_tokens: int  # what per-sequence contiguous allocation would reserve
    tokens_stored: int  # tokens in used pages (shared ones once)
    seconds: float
    n_cached: dict[int, int] = field(default_factory=dict)  # live sequence -> tokens in the pool after the step

    @property
    def tokens_decoded(self) -> int:
        return sum(1 for s in self.seqs if s.next_token >= 0)


class BatchSession:
    def __init__(self, model, config: SessionConfig | None = None, batch: BatchConfig | None = None):
        self.model = model
        self.config = config or SessionConfig()
        self.batch = batch or BatchConfig()
        self.cache_config = self.config.cache_config(model.config)
        pool_pages = self.batch.pool_pages or self.batch.max_seqs * self.config.max_pages
        self.pool = SharedKVPool(self.cache_config, pool_pages, self.batch.prefix_caching)
        self.seqs: dict[int, SeqState] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []  # in admission order
        self.finished: list[int] = []
        self.n_steps = 0
        self.preemptions = 0
        self._next_id = 0
        self._started = 0

    # --- submitting ------------------------------------------------------------------------------------
    def submit(self, prompt_ids, sampling: SamplingConfig | None = None, max_new_tokens: int | None = None) -> int:
        prompt_ids = tuple(int(t) for t in prompt_ids)
        if not prompt_ids:
            raise ConfigError("prompt", prompt_ids, "at least one token")
        seq = self._new_seq(prompt_ids, sampling, max_new_tokens)
        self.waiting.append(seq.seq_id)
        return seq.seq_id

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (in the chat template when the config says so)."""
        return encode_prompt(self.model, prompt, self.config.chat, self.config.special)

    def submit_parallel(self, prompt_ids, n: int, sampling: SamplingConfig | None = None) -> list[int]:
        """n samples of one prompt: seeds seed, seed+1, ...; the prompt is computed once and its pages
        are shared by all n (the partial last page is copied when each first writes to it)."""
        check_int("n", n, 1, MAX_SEQUENCES)
        sampling = sampling or self.config.sampling
        first = self.submit(prompt_ids, sampling)
        for i in range(1, n):
            child = self._new_seq(self.seqs[first].prompt_ids, _reseeded(sampling, sampling.seed + i), None)
            self.seqs[first].children.append(child.seq_id)
        return [first, *self.seqs[first].children]

    def fork(self, seq_id: int, n_tokens: int | None = None, sampling: SamplingConfig | None = None,
             max_new_tokens: int | None = None) -> int:
        """A new sequence that continues seq_id's first n_tokens tokens (all of its cached ones by default)
        with other sampling settings. A running parent's pages are shared directly (the child recomputes
        the last of those tokens to get its own next-token logits); a finished or waiting parent's
        tokens become the child's prompt, and the prefix cache shares whatever full pages it still holds."""
        parent = self.seqs[seq_id]
        sampling = sampling or parent.sampler.config
        if seq_id not in self.running:
            tokens = parent.tokens
            n = len(tokens) if n_tokens is None else check_int("n_tokens", n_tokens, 1, len(tokens))
            return self.submit(tokens[:n], sampling, max_new_tokens)
        n = parent.n_cached if n_tokens is None else check_int("n_tokens", n_tokens, 1, parent.n_cached)
        tokens = parent.tokens[:n]
        n_prompt = min(len(parent.prompt_ids), n)
        child = self._new_seq(tuple(tokens[:n_prompt]), sampling, max_new_tokens)
        child.generated = tokens[n_prompt:]
        self.pool.fork(seq_id, child.seq_id, n - 1)
        child.n_cached = n - 1
        self._start(child)
        return child.seq_id

    def _new_seq(self, prompt_ids, sampling, max_new_tokens) -> SeqState:
        limit = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        seq = SeqState(self._next_id, tuple(prompt_ids), Sampler(sampling or self.config.sampling), limit)
        self.seqs[seq.seq_id] = seq
        self._next_id += 1
        return seq

    # --- state -----------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.running and not self.waiting

    def text(self, seq_id: int) -> str:
        seq = self.seqs[seq_id]
        ids = seq.generated[:-1] if seq.stop_reason == "eos" else seq.generated
        return decode_ids(self.model, ids)

    # --- stepping --------------------------------------------------------------------------------------
    def run(self) -> Iterator[BatchRecord]:
        while not self.done:
            yield self.step()

    def step(self) -> BatchRecord:
        if self.done:
            raise RuntimeError("no sequence is waiting or running")
        started = time.perf_counter()
        self.pool.step = self.n_steps
        plan = self._schedule()
        if not plan:  # every running sequence just finished with a full cache
            record = self._record((), time.perf_counter() - started)
            self.n_steps += 1
            return record
        ids = np.concatenate([np.asarray(tokens, dtype=np.int64) for _, tokens, _ in plan])
        positions = np.concatenate([np.arange(start, start + len(tokens), dtype=np.int64)
                                    for _, tokens, start in plan])
        segments, samplers, offset = [], [], 0
        for seq_id, tokens, start in plan:
            segments.append((seq_id, offset, offset + len(tokens)))
            self.pool.extend(seq_id, tokens)
            if start + len(tokens) == len(self.seqs[seq_id].tokens):
                samplers.append((seq_id, offset + len(tokens) - 1))
            offset += len(tokens)
        rows = np.array([row for _, row in samplers], dtype=np.int64)
        logits = self.model.forward(ids, positions, self._batched_attend(segments), logit_rows=rows)
        steps = {}
        for seq_id, tokens, start in plan:
            self.seqs[seq_id].n_cached = start + len(tokens)
            self.pool.commit(seq_id)
            steps[seq_id] = SeqStep(seq_id, "prefill" if start + 1 < len(self.seqs[seq_id].tokens) else "decode",
                                    len(tokens), -1)
        for (seq_id, _), row in zip(samplers, logits):
            for child_id in self._fork_children(seq_id):
                steps[child_id] = SeqStep(child_id, "fork", 0, self._sample(child_id, row))
            steps[seq_id] = SeqStep(seq_id, steps[seq_id].kind, steps[seq_id].n_tokens, self._sample(seq_id, row))
        record = self._record(tuple(steps.values()), time.perf_counter() - started)
        self.n_steps += 1
        return record

    def _batched_attend(self, segments):
        pool = self.pool

        def attend(layer, q, k, v, positions):
            out = np.empty_like(q)
            for seq_id, start, end in segments:
                pool.append(seq_id, layer, k[start:end], v[start:end], positions[start:end])
                out[start:end] = pool.attend(seq_id, layer, q[start:end], positions[start:end]).output
            return out

        return attend

    def _fork_children(self, seq_id: int) -> list[int]:
        seq = self.seqs[seq_id]
        children, seq.children = seq.children, []
        for child_id in children:
            self.pool.fork(seq_id, child_id)
            self.seqs[child_id].n_cached = seq.n_cached
            self._start(self.seqs[child_id])
        return children

    def _sample(self, seq_id: int, logits: np.ndarray) -> int:
        seq = self.seqs[seq_id]
        token = seq.sampler.sample(logits)
        seq.generated.append(token)
        if token in self.model.config.eos_ids and not self.batch.ignore_eos:
            self._finish(seq, "eos")
        elif len(seq.generated) >= seq.max_new_tokens:
            self._finish(seq, "max_new_tokens")
        return token

    def _finish(self, seq: SeqState, reason: str) -> None:
        seq.stop_reason = reason
        self.running.remove(seq.seq_id)
        self.finished.append(seq.seq_id)
        self.pool.free(seq.seq_id)
        # parallel samples still waiting for this prompt (it ended before its first token): they run alone
        self.waiting.extend(seq.children)
        seq.children = []

    # --- scheduling ------------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[int, list[int], int]]:
        """(seq_id, tokens to feed, first position) for this step: the running sequences that fit, then
        waiting ones while the pool has room. Preempts the newest running sequence until the rest fit.
        A sequence whose budget is full under policy 'none' finishes ("cache_full"); the others go on."""
        for seq_id in list(self.running):
            if self.pool.room(seq_id) <= 0 and not self.pool.sequences[seq_id].policy.evicts:
                self._finish(self.seqs[seq_id], "cache_full")
        while True:
            plan = [self._next_chunk(seq_id) for seq_id in self.running]
            needs = [self.pool.pages_needed(seq_id, len(tokens)) for seq_id, tokens, _ in plan]
            total = np.sum(needs, axis=0) if needs else np.zeros(len(self.pool.stores), dtype=np.int64)
            if all(total[layer] <= blocks.n_free() for layer, blocks in enumerate(self.pool.blocks)):
                break
            if len(self.running) == 1:
                raise CacheFullError(f"the pool of {self.pool.pool_pages} pages per layer cannot hold the next "
                                     f"step of sequence {self.running[0]} alone; raise pool_pages")
            self._preempt(self.running[-1])
        while self.waiting and len(self.running) < self.batch.max_seqs:
            seq = self.seqs[self.waiting[0]]
            self.pool.add_sequence(seq.seq_id)
            seq.n_cached = self.pool.match_prefix(seq.seq_id, seq.tokens)
            if self.pool.room(seq.seq_id) <= 0 and not self.pool.sequences[seq.seq_id].policy.evicts:
                self._start(self.seqs[self.waiting.popleft()])  # its cached prefix already fills its budget
                self._finish(seq, "cache_full")
                continue
            chunk = self._next_chunk(seq.seq_id)
            need = self.pool.pages_needed(seq.seq_id, len(chunk[1]))
            if any(total[layer] + need[layer] > blocks.n_free() for layer, blocks in enumerate(self.pool.blocks)):
                self.pool.free(seq.seq_id, None)
                if not self.running:
                    raise CacheFullError(f"the pool of {self.pool.pool_pages} pages per layer cannot hold "
                                         f"{len(chunk[1])} tokens of sequence {seq.seq_id}; raise pool_pages")
                break
            self.waiting.popleft()
            if self.batch.prefix_caching:
                self.pool.prefix_stats.record(len(seq.tokens), seq.n_cached)
            self._start(seq)
            total = total + np.asarray(need)
            plan.append(chunk)
        return plan

    def _next_chunk(self, seq_id: int) -> tuple[int, list[int], int]:
        seq = self.seqs[seq_id]
        tokens = seq.tokens
        n = max(1, min(len(tokens) - seq.n_cached, self.pool.room(seq_id), MAX_CHUNK))
        return seq_id, tokens[seq.n_cached: seq.n_cached + n], seq.n_cached

    def _start(self, seq: SeqState) -> None:
        seq.started = self._started
        self._started += 1
        self.running.append(seq.seq_id)

    def _preempt(self, seq_id: int) -> None:
        seq = self.seqs[seq_id]
        self.running.remove(seq_id)
        self.pool.free(seq_id, "preempt")
        seq.n_cached = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq_id)

    def _record(self, seqs: tuple[SeqStep, ...], seconds: float) -> BatchRecord:
        pool = self.pool
        blocks, store = pool.blocks[0], pool.stores[0]
        used = blocks.ref_counts > 0
        capacity = self.cache_config.capacity
        reserved = sum(min(len(self.seqs[s].prompt_ids) + self.seqs[s].max_new_tokens, capacity)
                       for s in self.running)
        return BatchRecord(
            step=self.n_steps, seqs=seqs, events=tuple(pool.take_events()),
            block_tables={s: tuple(pool.block_table(s)) for s in self.running},
            ref_counts=blocks.ref_counts.copy(), fill=store.fill.copy(), cached_free=tuple(blocks.cached_free()),
            pages_used=pool.pages_used(), pages_unshared=pool.pages_unshared(),
            contiguous_reserved_tokens=reserved, tokens_stored=int(store.fill[used].sum()), seconds=seconds,
            n_cached={s: self.seqs[s].n_cached for s in self.running})


def _reseeded(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    return SamplingConfig(mode=sampling.mode, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seed=seed % 2**32)

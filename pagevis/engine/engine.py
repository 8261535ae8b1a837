"""The engine: requests in one cache, stepped together (vLLM's EngineCore loop: schedule, execute, update).

Each `step()` asks the scheduler what runs, feeds every scheduled request's tokens (a prefill chunk or one
decode token) through the model in ONE forward call — the weight matmuls take all rows at once, attention
runs per request over its own pages — samples each request whose known tokens are all in the cache, and
ends requests for every reason there is (eos, max_new_tokens, a stop string, a full cache under policy
'none', cancellation). Sampling is per request with its own seeded generator, so a request decodes the same
tokens whether it runs alone, in a batch, forked or preempted. Hooks see every step's record.

Every front end drives this class: the app's main window and `run` through DecodeSession (one request),
the sequences window and `run --n`, the server, and the benches.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Iterator

import numpy as np

from pagevis.kvcache import POLICIES, CacheConfig, CacheFullError, ConfigError, EventKind, KVCacheManager, make_policy
from pagevis.kvcache.attention_kernels import load_decode_kernel
from pagevis.kvcache.memory import HybridBytes, hybrid_bytes
from pagevis.kvcache.swap import SwapSpaceError
from pagevis.errors import check_int
from pagevis.engine import logprobs
from pagevis.engine.batch import MAX_CHUNK, MAX_SEQUENCES, BatchConfig, BatchRecord, SeqStep, int8_rows_of
from pagevis.engine.reconstruct import reconstruct_and_compress
from pagevis.engine.request import Request
from pagevis.engine.run_loop import RunControl, steps
from pagevis.engine.sampling import Sampler, SamplingConfig
from pagevis.engine.scheduler import Plan, Scheduler
from pagevis.engine.session_config import SessionConfig, decode_ids, encode_prompt
from pagevis.engine.stop import StopMatcher
from pagevis.kvcache.paged_attention import share_pool
from pagevis.model import int8_rows
from pagevis.model.quantized import running_spin_pool
from pagevis.model.resident import release_compiler_pages

EngineHook = Callable[[BatchRecord], None]
share_pool(running_spin_pool)  # batched decode attention's sequences shared with the weights' second thread


class Engine:
    def __init__(self, model, config: SessionConfig | None = None, batch: BatchConfig | None = None,
                 max_chunk: int | None = MAX_CHUNK, hold_finished: bool = False,
                 cache_config: CacheConfig | None = None):
        """max_chunk: prompt tokens one request feeds per step (None: as many as fit). hold_finished: keep a
        finished request's pages until `release` (the app shows the cache as the request left it).
        cache_config: `config`'s for this model, when the caller has built it already (a DecodeSession)."""
        self.model = model
        self.hold_finished = hold_finished
        self.config = config or SessionConfig()
        self.batch = batch or BatchConfig()
        self.cache_config = cache_config or self.config.cache_config(model.config)
        pool_pages = self.batch.pool_pages or self.batch.max_seqs * self.cache_config.n_page_ids
        self.cache = KVCacheManager(self.cache_config, pool_pages, self.batch.prefix_caching)
        self.cache.record_writes(False)  # BatchRecords keep no WRITE event (a DecodeSession's records turn them on)
        if load_decode_kernel():  # not in the first decode step; the linker's code pages go out again after it
            release_compiler_pages()
        self.scheduler = Scheduler(self.cache, self.batch.max_seqs, self.batch.token_budget, max_chunk)
        self.requests: dict[int, Request] = {}
        self.n_steps = 0
        self.last_plan: dict[int, tuple[list[int], int]] = {}  # seq -> (tokens fed, first position), last step
        self.last_logits: dict[int, np.ndarray] = {}  # seq -> logits of its last row fed, last step
        self.reconstruct_seconds = 0.0  # a compressing policy's reconstruction pass in the last step (kvzip)
        self.last_events: list = []  # every cache event of the last step (records keep all but writes)
        self.attention: dict[int, dict[int, tuple]] = {}  # watched seq -> layer -> (last query's weights, slots)
        self._watched: dict[int, tuple[int, ...]] = {}
        self._hooks: list[EngineHook] = []
        self._next_id = 0
        self._steps: dict[int, SeqStep] = {}  # this step's, by request
        self._ended: list[int] = []  # requests that ended since the last record

    def close(self) -> None:
        self.cache.close()

    # --- observers -------------------------------------------------------------------------------
    def add_hook(self, hook: EngineHook) -> None:
        """Call hook(record) on the stepping thread after every step (metrics, trace, GUI, servers...)."""
        self._hooks.append(hook)

    def remove_hook(self, hook: EngineHook) -> None:
        self._hooks.remove(hook)

    def watch_attention(self, seq_id: int, layers: tuple[int, ...]) -> None:
        """Keep the last query's attention weights of these layers of seq_id after each step."""
        self._watched[seq_id] = layers

    # --- submitting ------------------------------------------------------------------------------
    def submit(self, prompt_ids, sampling: SamplingConfig | None = None, max_new_tokens: int | None = None,
               stop: tuple[str, ...] = (), ignore_eos: bool | None = None, policy=None,
               scores: tuple[int | None, int | None] = (None, None)) -> int:
        """Queue a request; its id. `policy`: an eviction policy object instead of the settings' one.
        `scores`: (logprobs, prompt_logprobs), the top-k counts of the log-probabilities to keep of each
        generated token and of each prompt token (None: not wanted); see Request."""
        prompt_ids = tuple(int(t) for t in prompt_ids)
        if not prompt_ids:
            raise ConfigError("prompt", prompt_ids, "at least one token")
        self._check_compression(prompt_ids, policy)
        request = self._new_request(prompt_ids, sampling, max_new_tokens, stop, ignore_eos)
        request.policy = policy
        request.logprobs, request.prompt_logprobs = scores
        for name, k in zip(("logprobs", "prompt_logprobs"), scores):
            if k is not None:
                check_int(name, k, 0, logprobs.MAX_LOGPROBS)
        if request.prompt_logprobs is not None:
            request.prompt_scores = logprobs.Scores.empty(len(prompt_ids) - 1, request.prompt_logprobs)
            # its prompt rows stay exact where others' are int8: its pages must not be another prompt's hit
            request.exact_pages = self.batch.int8_rows in ("prompts", "all") and int8_rows.route() == "vnni"
        self.scheduler.add(request)
        return request.seq_id

    def _check_compression(self, prompt_ids: tuple[int, ...], policy) -> None:
        """A policy that compresses after the prefill (kvzip) needs the whole prompt in the cache, in RAM pages of a
        model without sliding-window layers: ConfigError naming the numbers otherwise."""
        if not (policy.compresses if policy is not None else POLICIES[self.cache_config.policy].compresses):
            return
        policy = policy or make_policy(self.cache_config)
        cfg = self.cache_config
        held, context = min(policy.capacity, self.cache.pool_pages * cfg.page_size), policy.context_of(len(prompt_ids))
        if context > held:
            whole = "prompt" if context == len(prompt_ids) else f"prompt's first {context} tokens (context)"
            raise ConfigError("max_pages", cfg.max_pages,
                              f"at least {-(-context // cfg.page_size)} pages of {cfg.page_size}: policy "
                              f"{policy.name!r} prefills the whole {whole} before compressing it, and the prompt is "
                              f"{len(prompt_ids)} tokens while the cache holds {held}")
        if any(self.cache.windows):
            raise ConfigError("policy", policy.name, "another policy on a model with sliding-window layers (its "
                              "reconstruction pass scores every layer's whole prompt; kvpress refuses Gemma 3 too)")

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (in the chat template when the config says so)."""
        return encode_prompt(self.model, prompt, self.config.chat, self.config.special)

    def submit_parallel(self, prompt_ids, n: int, sampling: SamplingConfig | None = None,
                        max_new_tokens: int | None = None, stop: tuple[str, ...] = (), ignore_eos: bool | None = None,
                        policy=None, scores: tuple[int | None, int | None] = (None, None)) -> list[int]:
        """n samples of one prompt: seeds seed, seed+1, ...; the prompt is computed once and its pages
        are shared by all n (the partial last page is copied when each first writes to it). The other
        arguments are submit's, for every sample (each child forks the first one's policy; the prompt's
        scores are the first one's)."""
        check_int("n", n, 1, MAX_SEQUENCES)
        sampling = sampling or self.config.sampling
        first = self.submit(prompt_ids, sampling, max_new_tokens, stop, ignore_eos, policy, scores)
        for i in range(1, n):
            child = self._new_request(self.requests[first].prompt_ids, _reseeded(sampling, sampling.seed + i),
                                      max_new_tokens, stop, ignore_eos)
            child.logprobs = scores[0]
            child.policy = None if policy is None else copy.deepcopy(policy)  # if the prompt ends before forking
            self.requests[first].children.append(child.seq_id)
        return [first, *self.requests[first].children]

    def fork(self, seq_id: int, n_tokens: int | None = None, sampling: SamplingConfig | None = None,
             max_new_tokens: int | None = None) -> int:
        """A new request that continues seq_id's first n_tokens tokens (all of its cached ones by default)
        with other sampling settings. A running parent's pages are shared directly (the child recomputes
        the last of those tokens to get its own next-token logits); a finished or waiting parent's
        tokens become the child's prompt, and the prefix cache shares whatever full pages it still holds."""
        parent = self.requests[seq_id]
        sampling = sampling or parent.sampler.config
        if parent not in self.scheduler.running:
            tokens = parent.tokens
            n = len(tokens) if n_tokens is None else check_int("n_tokens", n_tokens, 1, len(tokens))
            return self.submit(tokens[:n], sampling, max_new_tokens)
        n = parent.n_cached if n_tokens is None else check_int("n_tokens", n_tokens, 1, parent.n_cached)
        tokens = parent.tokens[:n]
        n_prompt = min(len(parent.prompt_ids), n)
        child = self._new_request(tuple(tokens[:n_prompt]), sampling, max_new_tokens, (), None)
        child.generated = tokens[n_prompt:]
        self.cache.fork(seq_id, child.seq_id, n - 1)
        child.n_cached = n - 1
        self.scheduler.start(child)
        return child.seq_id

    def cancel(self, seq_id: int, reason: str = "cancelled") -> None:
        """End a request now (a client went away, the user interrupted); its pages go back to the pool."""
        request = self.requests[seq_id]
        if not request.done:
            self.scheduler.remove(request)
            self._end(request, reason)
        self.release(seq_id)

    def release(self, seq_id: int) -> None:
        """Free the pages a finished request still holds (with hold_finished)."""
        if self.requests[seq_id].done and self.cache.has_sequence(seq_id):
            self.cache.free(seq_id)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's record (a server keeps only what it still serves)."""
        request = self.requests[seq_id]
        if not request.done:
            raise RuntimeError(f"request {seq_id} is still {'waiting' if request.started < 0 else 'running'}")
        self.release(seq_id)
        del self.requests[seq_id]
        self.attention.pop(seq_id, None)
        self._watched.pop(seq_id, None)

    def _new_request(self, prompt_ids, sampling, max_new_tokens, stop, ignore_eos) -> Request:
        limit = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        request = Request(self._next_id, tuple(prompt_ids), Sampler(sampling or self.config.sampling), limit,
                          self.batch.ignore_eos if ignore_eos is None else ignore_eos, tuple(s for s in stop if s))
        self.requests[request.seq_id] = request
        self._next_id += 1
        return request

    # --- state -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.scheduler.idle

    @property
    def running(self) -> list[int]:
        return [r.seq_id for r in self.scheduler.running]

    @property
    def waiting(self) -> list[int]:
        return [r.seq_id for r in self.scheduler.waiting]

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    def text(self, seq_id: int) -> str:
        request = self.requests[seq_id]
        ids = request.generated[:-1] if request.stop_reason == "eos" else request.generated
        return decode_ids(self.model, ids)

    # --- stepping --------------------------------------------------------------------------------
    def run(self, control: RunControl | None = None) -> Iterator:
        """Step through the one run loop until done (or as `control` says); yield each record."""
        return steps(self, control)

    def step(self) -> BatchRecord:
        """One step of every scheduled request. Raises CacheFullError when the pool cannot hold even one
        request's next step, and SwapSpaceError when the disk tier has no room; both before anything changed."""
        if self.done:
            raise RuntimeError("no request is waiting or running")
        started = time.perf_counter()
        self.cache.step = self.n_steps
        self.last_plan, self.last_logits, self._steps = {}, {}, {}
        self.reconstruct_seconds = 0.0  # a compressing policy's reconstruction pass in this step
        plan = self.scheduler.schedule(self._finish)
        if plan:
            try:
                self._execute(plan)
            except SwapSpaceError as error:  # raised before any K/V was written: the requests end here
                for request, _, _ in plan:
                    request.error = error.strerror or str(error)
                    self._finish(request, "swap_full")
                raise
        record = self._record(started)
        self.n_steps += 1
        for hook in self._hooks:
            hook(record)
        return record

    def _execute(self, plan: Plan) -> None:
        self.cache.admission.ensure_rooms([(request.seq_id, len(tokens)) for request, tokens, _ in plan])
        ids = np.array([t for _, tokens, _ in plan for t in tokens], dtype=np.int64)
        positions = _joined([np.arange(start, start + len(tokens), dtype=np.int64) for _, tokens, start in plan])
        segments, offset = [], 0
        for request, tokens, start in plan:
            segments.append((request.seq_id, offset, offset + len(tokens)))
            self.cache.extend(request.seq_id, tokens)
            self.last_plan[request.seq_id] = (tokens, start)
            offset += len(tokens)
        # the last row of each request; every row of one scoring its prompt
        scoring = any(request.prompt_logprobs is not None for request, _, _ in plan)
        if scoring:
            wanted = [np.arange(begin if request.prompt_logprobs is not None else end - 1, end)
                      for (request, _, _), (_, begin, end) in zip(plan, segments, strict=True)]
            rows, ends = np.concatenate(wanted), np.cumsum([len(w) for w in wanted])
        else:
            rows = np.array([end - 1 for _, _, end in segments], dtype=np.int64)
        int8, masks = int8_rows_of(plan, self.batch.int8_rows)
        forward_started = time.perf_counter()
        with int8_rows.batched(int8, masks):
            all_rows = self.model.forward(ids, positions, self._batched_attend(segments), logit_rows=rows)
        self.forward_seconds = time.perf_counter() - forward_started
        logits = all_rows  # without scoring: one row a request, in the plan's order
        if scoring:
            for (request, tokens, start), end in zip(plan, ends, strict=True):
                if request.prompt_logprobs is not None:
                    self._score_prompt(request, start, all_rows[end - len(tokens): end])
            logits = all_rows[ends - 1]
        for (request, tokens, start), row in zip(plan, logits, strict=True):
            request.n_cached = start + len(tokens)
            request.steps += 1
            self.cache.commit(request.seq_id, prompt_done=request.n_cached >= len(request.prompt_ids))
            policy = self.cache.policy(request.seq_id)
            if policy.compresses and not policy.compressed and request.n_cached >= policy.context_of(
                    len(request.prompt_ids)):
                self.reconstruct_seconds = reconstruct_and_compress(self.model, self.cache, request.seq_id)
            self.last_logits[request.seq_id] = row
            kind = "prefill" if start + 1 < request.n_tokens else "decode"
            self._steps[request.seq_id] = SeqStep(request.seq_id, kind, len(tokens), -1)
        for (request, tokens, start), row in zip(plan, logits, strict=True):
            if request.n_cached == request.n_tokens:
                for child_id in self._fork_children(request):
                    self._steps[child_id] = SeqStep(child_id, "fork", 0, self._sample(self.requests[child_id], row))
                step = self._steps[request.seq_id]  # (SeqStep's fields: `replace` costs ~6 us a request)
                self._steps[request.seq_id] = SeqStep(step.seq_id, step.kind, step.n_tokens, self._sample(request, row))

    @staticmethod
    def _score_prompt(request: Request, start: int, rows: np.ndarray) -> None:
        """Keep the log-probabilities of the prompt tokens these rows (positions start..) predict."""
        n = min(len(rows), len(request.prompt_ids) - 1 - start)
        if n > 0:
            nexts = request.prompt_ids[start + 1: start + 1 + n]
            scores, top = request.prompt_scores, request.prompt_logprobs
            assert scores is not None and top is not None  # set together when the request is submitted
            scores.put(start, logprobs.score(rows[:n], nexts, top))

    def _batched_attend(self, segments):
        cache, watched, attention = self.cache, self._watched, self.attention
        ids = [seq_id for seq_id, _, _ in segments]  # (once a step: every layer asks)
        decoding = len(ids) > 1 and all(end - start == 1 for _, start, end in segments)
        starts = np.array([start for _, start, _ in segments] + [segments[-1][2]], np.int64)

        def attend(layer, q, k, v, positions):
            if len(segments) == 1:  # one request (every row its own, however the model splits its forward:
                # compare's pieces): what the loop below does for one piece, without its lists (a decode step's)
                seq_id = segments[0][0]
                # (append, attend: one call; a prefill's weights only for the last row, all that is kept)
                result = cache.write_and_attend(seq_id, layer, q, k, v, positions, all_weights=False)
                if layer in watched.get(seq_id, ()):
                    attention.setdefault(seq_id, {})[layer] = (result.weights[-1].copy(), result.slots)
                return np.asarray(result.output, dtype=q.dtype)
            if decoding:  # every sequence decodes one token (row i is ids[i]'s): write them all, then one batched
                # attention, where the cache can (`can_attend_many`: else None, nothing written)
                wanted = [i for i, seq_id in enumerate(ids) if layer in watched.get(seq_id, ())] if watched else ()
                batched = cache.decode_many(ids, layer, q, k, v, positions, wanted)
                if batched is not None:
                    output, kept = batched
                    for i, result in kept.items():
                        attention.setdefault(ids[i], {})[layer] = (result.weights[-1].copy(), result.slots)
                    return np.asarray(output, dtype=q.dtype)
            for seq_id, start, end in segments:
                cache.append(seq_id, layer, k[start:end], v[start:end], positions[start:end])
            # then every sequence's rows in one kernel call, where the cache can (`can_attend_chunks`: else None)
            wanted = [i for i, seq_id in enumerate(ids) if layer in watched.get(seq_id, ())] if watched else ()
            chunked = cache.attend_chunks(ids, layer, q, positions, starts, wanted)
            if chunked is not None:
                output, kept = chunked
                for i, result in kept.items():
                    attention.setdefault(ids[i], {})[layer] = (result.weights[-1].copy(), result.slots)
                return np.asarray(output, dtype=q.dtype)
            results = [cache.attend(seq_id, layer, q[start:end], positions[start:end], all_weights=False)
                       for seq_id, start, end in segments]
            out = np.empty_like(q)
            for (seq_id, start, end), result in zip(segments, results, strict=True):
                out[start:end] = result.output
                if layer in watched.get(seq_id, ()):
                    attention.setdefault(seq_id, {})[layer] = (result.weights[-1].copy(), result.slots)
            return out

        return attend

    def _fork_children(self, request: Request) -> list[int]:
        children, request.children = request.children, []
        for child_id in children:
            self.cache.fork(request.seq_id, child_id)
            self.requests[child_id].n_cached = request.n_cached
            self.scheduler.start(self.requests[child_id])
            self.last_plan[child_id] = ([], request.n_cached)
        return children

    def _sample(self, request: Request, logits: np.ndarray) -> int:
        token = request.sampler.sample(logits)
        request.generated.append(token)
        if request.logprobs is not None:
            request.token_scores.append(logprobs.score(logits, [token], request.logprobs))
        if token in self.model.config.eos_ids and not request.ignore_eos:
            self._finish(request, "eos")
        elif len(request.generated) >= request.max_new_tokens:
            self._finish(request, "max_new_tokens")
        elif request.stop and self._stop_hit(request, token):
            self._finish(request, "stop")
        return token

    def _stop_hit(self, request: Request, token: int) -> bool:
        """Whether this token completes one of the request's stop strings: a matcher per request (stop.py) fed
        each token's text once, linear in the text (rebuilt from the tokens so far after a fork)."""
        state = request.stop_state
        if state is None or state[2] != len(request.generated) - 1:
            decoder, matcher = self.model.tokenizer.incremental_decoder(), StopMatcher(list(request.stop))
            for earlier in request.generated[:-1]:
                matcher.push(decoder.feed(earlier))
            state = request.stop_state = [decoder, matcher, len(request.generated) - 1]
        state[2] += 1
        return state[1].push(state[0].feed(token))[1]

    def _finish(self, request: Request, reason: str) -> None:
        if reason == "cache_full":
            try:  # the policy's own message says why (policy 'none' never evicts)
                self.cache.policy(request.seq_id).choose_victims(self.cache.view(request.seq_id, 0))
            except CacheFullError as error:
                request.error = str(error)
        self.scheduler.remove(request)
        if not (self.hold_finished or request.hold):
            self.cache.free(request.seq_id)
        # parallel samples still waiting for this prompt (it ended before its first token): they run alone
        for child_id in request.children:
            self.scheduler.add(self.requests[child_id])
        request.children = []
        self._end(request, reason)

    def _end(self, request: Request, reason: str) -> None:
        request.stop_reason = reason
        self._ended.append(request.seq_id)

    def _record(self, started: float) -> BatchRecord:
        cache = self.cache
        events, write = cache.take_events(), EventKind.WRITE  # (a batch's ~one write event per row and layer)
        self.last_events = events
        ended, self._ended = tuple(self._ended), []
        pool = cache.pool(0)
        # every layer's pages in use (each has its own pool): the counts are the fullest layer's, over every kind of
        # layer (Gemma 3's layer 0 is a sliding-window one, holding at most its window); layer 0's on a tie
        used = [cache.pages_used(layer) for layer in range(self.cache_config.n_layers)]
        fullest = used.index(max(used))
        counted = pool if fullest == 0 else cache.pool(fullest)
        capacity = self.cache_config.capacity
        running = self.scheduler.running
        reserved = sum(min(len(r.prompt_ids) + r.max_new_tokens, capacity) for r in running)
        return BatchRecord(
            step=self.n_steps, seqs=tuple(self._steps.values()),
            events=tuple(e for e in events if e.kind is not write),
            block_tables={r.seq_id: tuple(cache.block_table(r.seq_id, 0)) for r in running},
            ref_counts=pool.ref_counts, fill=pool.fill, cached_free=pool.cached_free,
            pages_used=used[fullest], pages_unshared=cache.pages_unshared(fullest), contiguous_reserved_tokens=reserved,
            tokens_stored=int(counted.fill[counted.ref_counts > 0].sum()), seconds=time.perf_counter() - started,
            n_cached={r.seq_id: r.n_cached for r in running}, waiting=len(self.scheduler.waiting), ended=ended,
            hybrid=self._hybrid_bytes(used))

    def _hybrid_bytes(self, used: list[int]) -> HybridBytes | None:
        """The pool's pages in use per layer (`used`), by layer type, when some layer has a sliding window."""
        if not any(self.cache.windows):  # the cache's per-layer windows, as _check_compression reads them
            return None
        config = self.cache_config
        longest = max((r.n_cached for r in self.scheduler.running), default=0)
        return hybrid_bytes(config.layer_specs, used, config.page_bytes(), longest, config.page_size)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _reseeded(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    return SamplingConfig(mode=sampling.mode, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seed=seed % 2**32)

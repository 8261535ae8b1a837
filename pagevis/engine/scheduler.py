"""Which requests run in the next step, and what each feeds (vLLM v1's scheduler in miniature).

Running requests come first: each feeds one decode token or its next prefill chunk; then waiting ones are
admitted, oldest first, while fewer than `max_running` run and the pool has the pages. A per-step token
budget (if set) bounds the tokens of one step, so a long prompt is prefilled in chunks between everyone
else's decode steps rather than stalling them. When the pool cannot hold the next step, the most recently
admitted request is preempted: its pages are freed (a PREEMPT event) and it goes back to the head of the
waiting queue; when admitted again it recomputes its tokens (a prefill of prompt + generated text, much of
it found in the prefix cache). Preemption always recomputes: with a disk tier every page already has a
disk frame and RAM is only a cache of them, so a step never runs out of RAM — only out of page ids, which
swapping cannot give back.

A paused request (a server's session between calls) holds its pages but neither runs nor counts against
`max_running`, and is never preempted.

The scheduler touches no page: toward the cache it asks `admit` (a new sequence, with its prefix hit),
`chunk_limit`, `is_full`, `allocate` (a Reservation of the step's pages, or None: kvcache/admission.py) and
`free`; besides, it reads `pool_pages` for its CacheFullError messages and records each admission's prefix hit in
`prefix_stats`.
"""

from __future__ import annotations

from collections import deque


from pagevis.kvcache import CacheFullError, EventKind, KVCacheManager
from pagevis.engine.request import Request

Plan = list[tuple[Request, list[int], int]]  # (request, tokens to feed, position of the first)


class Scheduler:
    def __init__(self, cache: KVCacheManager, max_running: int, token_budget: int | None = None,
                 max_chunk: int | None = None):
        self.cache = cache
        self.admission = cache.admission  # the questions it asks (kvcache/admission.py)
        self.max_running = max_running
        self.token_budget = token_budget  # tokens per step over all requests; None: no limit
        self.max_chunk = max_chunk  # prompt tokens one request feeds per step; None: no limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self._admitted = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not any(not r.paused for r in self.running)

    @property
    def n_active(self) -> int:
        """Running requests that are not paused (a paused one holds its pages, not a place in the batch)."""
        return sum(1 for r in self.running if not r.paused)

    def add(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def start(self, request: Request) -> None:
        """Count request as running (admitted now: preemption takes the newest)."""
        request.started = self._admitted
        self._admitted += 1
        self.running.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, finish) -> Plan:
        """The plan of the next step. `finish(request, reason)` ends a request that cannot go on (its
        budget is full under policy 'none'); CacheFullError when the pool cannot hold even one request."""
        cache = self.cache
        for request in list(self.running):
            if not request.paused and self.admission.is_full(request.seq_id):
                finish(request, "cache_full")
        budget = self.token_budget
        while True:
            plan = self._running_plan(budget)
            held = self.admission.allocate([(r.seq_id, len(tokens)) for r, tokens, _ in plan])
            if held is not None:
                break
            active = [r for r in self.running if not r.paused]
            if len(active) == 1:
                raise CacheFullError(f"the pool of {cache.pool_pages} pages per layer cannot hold the next step "
                                     f"of sequence {active[0].seq_id} alone; raise pool_pages")
            self.preempt(active[-1])
        used = sum(len(tokens) for _, tokens, _ in plan)
        while self.waiting and self.n_active < self.max_running and (budget is None or used < budget):
            request = self.waiting[0]
            request.n_cached = self.admission.admit(request.seq_id, request.tokens, request.policy, self._longest(request),
                                           request.prefix_salt)
            if self.admission.is_full(request.seq_id):
                self.start(self.waiting.popleft())  # its cached prefix already fills its budget
                finish(request, "cache_full")
                continue
            chunk = self._chunk(request, None if budget is None else budget - used)
            reserved = self.admission.allocate([(request.seq_id, len(chunk[1]))], held)
            if reserved is None:
                cache.free(request.seq_id, None)
                if not self.running:
                    raise CacheFullError(f"the pool of {cache.pool_pages} pages per layer cannot hold "
                                         f"{len(chunk[1])} tokens of sequence {request.seq_id}; raise pool_pages")
                break
            self.waiting.popleft()
            request.prefix_hit_tokens = request.n_cached
            if cache.prefix_caching:
                cache.prefix_stats.record(len(request.tokens), request.n_cached)
            self.start(request)
            held = reserved
            used += len(chunk[1])
            plan.append(chunk)
        return plan

    @staticmethod
    def _longest(request: Request) -> int | None:
        """The tokens the request may grow to, which bounds what it may take from the prefix cache (`admit`);
        None for a request scoring its prompt: it takes nothing from it, it needs every prompt token's logits."""
        if request.prompt_logprobs is not None:
            return None
        return len(request.prompt_ids) + request.max_new_tokens

    def _running_plan(self, budget: int | None) -> Plan:
        """Decode tokens first (one per request), then prefill chunks within what the budget leaves."""
        active = [r for r in self.running if not r.paused]
        # (flags by position: `request in decoding` compared Requests field by field, ~2 us a pair)
        decoding = [r.n_tokens - r.n_cached == 1 for r in active]
        plan = [self._chunk(r, None) for r, decodes in zip(active, decoding) if decodes]
        left = None if budget is None else budget - len(plan)
        for request, decodes in zip(active, decoding):
            if decodes or (left is not None and left <= 0):
                continue
            chunk = self._chunk(request, left)
            plan.append(chunk)
            left = None if left is None else left - len(chunk[1])
        return sorted(plan, key=lambda chunk: chunk[0].started)

    def _chunk(self, request: Request, left: int | None) -> tuple[Request, list[int], int]:
        """The request's next tokens: its room (1 when its policy must evict to go on), the cache's own chunk
        limit (disk tier, Quest), the scheduler's, and what the step's budget leaves."""
        remaining, n = request.n_tokens - request.n_cached, 1
        if remaining > 1:  # (else one token whatever the limits say: a decode token does not ask them)
            limits = [remaining, self.admission.chunk_limit(request.seq_id)]
            limits += [limit for limit in (self.max_chunk, left) if limit is not None]
            n = max(1, min(limits))
        return request, request.tokens_in(request.n_cached, request.n_cached + n), request.n_cached

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request.seq_id, EventKind.PREEMPT)
        request.n_cached = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

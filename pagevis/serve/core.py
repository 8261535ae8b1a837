"""The server's engine core: one Engine, stepped by one thread through the one run loop (vLLM's EngineCore).

Every request the server decodes — a completion, each of a chat's n samples, a /v1/sessions session — is a
request in this engine: they join and leave between steps, and every step is one batched forward over all
of them. Once its thread runs, other threads never change the engine (they read only its pool size): they queue
commands (`call`), which the engine thread runs between steps, and read what it pushes:

- a completion's tokens go to its `Output`, an asyncio queue the event loop reads, each with its
  log-probabilities if asked; its end comes last, with the engine's stop reason (and the prompt's
  log-probabilities if asked). What a step gives every output goes over in ONE hand-off to the event loop
  after the step (one call_soon_threadsafe, one wake-up of the loop, however many requests the batch holds),
  not one per token: each wake-up is a write to the loop's self-pipe and a contest for the GIL;
- a session is a request that pauses between HTTP calls: `step_session(session, n)` unpauses it, the core
  builds its record after each step that fed it (`DecodeSession.take_step`, masked to its own pages) and
  pauses it again after n of them, keeping its pages (they count as held, not running);
- `cancel` ends a request at once (its client went away): its pages go back to the pool before the next step.

When nothing can run (paused sessions hold the pool and the waiting requests do not fit) the thread sleeps
until a command comes rather than spinning. An unexpected error in a step ends the requests that were
running with stop reason "error" (their K/V may be half written); the engine goes on with the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pagevis.engine import RunControl, steps
from pagevis.kvcache import CacheFullError
from pagevis.kvcache.swap import SwapSpaceError
from pagevis.serve.errors import ApiError

log = logging.getLogger("pagevis.serve")
IDLE_WAIT = 0.05  # seconds the thread waits for a command after a step that could run nothing


class Output:
    """One request's output, read on the event loop: ("token", id) items, then ("end", stop reason, error)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, item: tuple) -> None:  # any thread
        _hand_over(self.loop, [(self, item)])

    async def get(self) -> tuple:
        return await self.queue.get()


@dataclass
class StepOrder:
    """A session's pending HTTP step call: n more of its steps, the records taken so far, and the future the
    handler awaits (resolved on the event loop)."""

    session: object
    left: int
    future: asyncio.Future
    records: list = field(default_factory=list)

    def resolve(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if not self.future.done():
                if error is None:
                    self.future.set_result(self.records)
                else:
                    self.future.set_exception(error)
        try:
            self.future.get_loop().call_soon_threadsafe(done)
        except RuntimeError:
            pass


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[Output, tuple]]) -> None:
    """Put every (output, item) into its queue on the loop, in order, with one wake-up of the loop."""
    def deliver() -> None:
        for output, item in items:
            output.queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the loop has closed: nobody reads these any more
        pass


class EngineCore:
    def __init__(self, engine, name: str, observer=None) -> None:
        self.engine = engine
        self.name = name
        self.observer = observer
        self.outputs: dict[int, Output] = {}
        self.orders: dict[int, StepOrder] = {}
        self.control = RunControl()
        self.last_step = time.monotonic()
        self.holders = 0  # completions in flight and sessions that live here (counted on the event loop)
        self._inbox: deque = deque()
        self._outbox: list[tuple[Output, tuple]] = []  # what this step gave the outputs, handed over after it
        self._wake = threading.Condition()
        self._stopping = False
        engine.add_hook(self._after_step)
        self.thread = threading.Thread(target=self._run, name=f"pagevis-engine-{name}", daemon=True)
        self.thread.start()

    # --- any thread ------------------------------------------------------------------------------
    def call(self, function, *args) -> concurrent.futures.Future:
        """Run function(*args) on the engine thread between steps; its result (or error) in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                future.set_exception(RuntimeError("the engine has stopped"))
                return future
            self._inbox.append((function, args, future))
            self._wake.notify()
        return future

    async def run(self, function, *args):
        return await asyncio.wrap_future(self.call(function, *args))

    @property
    def busy(self) -> bool:
        """Whether anything is or will be decoded here: a completion in flight, a session, a request."""
        return bool(self.holders or self.outputs or self.orders or self.engine.requests)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current step: every request still in the engine ends ("abort"); the thread exits."""
        with self._wake:
            self._stopping = True
            self.control.stop = True
            self._wake.notify()
        self.thread.join(timeout)

    # --- commands (engine thread) ----------------------------------------------------------------
    def submit(self, prompt_ids, sampling, max_new_tokens: int, stop: tuple[str, ...], ignore_eos: bool, policy,
               n: int, outputs: list[Output], scores: tuple[int | None, int | None] = (None, None),
               cache_salt: str | None = None, queued: float | None = None) -> list[int]:
        """A completion (n = 1) or n parallel samples of one prompt; each sample's tokens to its output.
        scores: the log-probabilities to keep (Engine.submit's); cache_salt: vLLM's (set before any step); queued:
        when the submit was queued (time.monotonic(): a request that arrives during a step waits from then)."""
        engine = self.engine
        if n == 1:
            ids = [engine.submit(prompt_ids, sampling, max_new_tokens, stop, ignore_eos, policy, scores)]
        else:
            ids = engine.submit_parallel(prompt_ids, n, sampling, max_new_tokens, stop, ignore_eos, policy, scores)
        for seq_id, output in zip(ids, outputs, strict=True):
            engine.requests[seq_id].cache_salt = cache_salt
            self.outputs[seq_id] = output
            self._observe("arrived", seq_id, queued)
        return ids

    def cancel(self, seq_ids, reason: str = "cancelled") -> None:
        """End these requests now and free their pages (a client left; the server is shutting down)."""
        for seq_id in seq_ids:
            self._end(seq_id, reason)
        self._settle()

    def step_session(self, order: StepOrder) -> None:
        """Take n more steps of a session (submitting it on its first call), then pause it again."""
        session = order.session
        if session.request is None:
            session.submit()
            session.pool.attach(session.seq_id, self.engine.cache)
            self._observe("arrived", session.seq_id)
        elif session.request.done:  # a full cache under policy 'none': no step can be taken
            order.resolve()
            return
        else:
            session.request.paused = False
            self._observe("resumed", session.seq_id)
        self.orders[session.seq_id] = order

    def close_session(self, session) -> None:
        """The session is deleted or expired: end its request, free its pages, forget it."""
        if session.request is None:
            return
        seq_id = session.seq_id
        self.orders.pop(seq_id, None)
        if seq_id in self.engine.requests:
            if not session.request.done:
                self._observe("finished", seq_id)
                self.engine.cancel(seq_id)
            self.engine.forget(seq_id)

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wait(None)
                self._apply()
                if self._stopping:
                    break
                self._step_while_busy()
        except BaseException:  # a bug in the core itself: say so, and leave no request waiting forever
            log.exception("engine core %s failed", self.name)
        finally:
            self._abort_everything()

    def _step_while_busy(self) -> None:
        try:
            for record in steps(self.engine, self.control):
                self.last_step = time.monotonic()
                self._settle()
                self._hand_over()
                self._apply()
                if not record.seqs and not record.ended:  # nothing fits until a session lets go of its pages
                    self._wait(IDLE_WAIT)
                    self._apply()
        except CacheFullError as error:  # one request cannot go on even alone: it ends here
            self._refuse(error)
        except SwapSpaceError:  # the engine ended the step's requests ("swap_full")
            pass
        except Exception as error:  # a bug: the running requests' K/V may be half written
            log.exception("engine step failed")
            self._fail(error)
        self._settle()
        self._hand_over()

    def _wait(self, timeout: float | None) -> None:
        with self._wake:
            if timeout is None:
                while not self._inbox and not self._stopping and self.engine.done:
                    self._wake.wait()
            elif not self._inbox and not self._stopping:
                self._wake.wait(timeout)

    def _apply(self) -> None:
        applied = False
        while True:
            with self._wake:
                if not self._inbox:
                    break
                function, args, future = self._inbox.popleft()
            applied = True
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)
        if applied:  # (after a step the observer has counted the queues already)
            self._hand_over()  # a cancel's ends
            self._observe("queues")

    def _hand_over(self) -> None:
        """Hand what the outputs got since the last hand-off to their event loops: one wake-up per loop."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for output, item in items:
            loops.setdefault(output.loop, []).append((output, item))
        for loop, theirs in loops.items():
            _hand_over(loop, theirs)

    # --- after every step (engine thread, inside Engine.step) -----------------------------------
    def _after_step(self, record) -> None:
        cache = self.engine.cache
        counts = cache.take_counts() if cache.config.tiered else None
        for seq in record.seqs:
            if seq.next_token >= 0:
                output = self.outputs.get(seq.seq_id)
                if output is not None:
                    request = self.engine.requests[seq.seq_id]
                    row = request.token_scores[-1].row(0) if request.logprobs is not None else None
                    self._outbox.append((output, ("token", seq.next_token, row)))
        answered = []  # step calls answered once the metrics have seen this step
        for seq_id, order in list(self.orders.items()):
            if seq_id not in self.engine.last_plan:
                continue
            try:
                order.records.append(order.session.take_step(record, counts=counts))
            except Exception as error:  # noqa: BLE001 - the session's record failed (a bug): it ends here
                log.exception("session record failed")
                del self.orders[seq_id]
                order.session.request.error = f"{type(error).__name__}: {error}"
                self.engine.cancel(seq_id, "error")
                self._observe("finished", seq_id)
                order.resolve(_internal(order.session.request.error))
                continue
            order.left -= 1
            if order.left <= 0 and not order.session.request.done:
                order.session.request.paused = True
                self._observe("paused", seq_id)
                del self.orders[seq_id]
                answered.append(order)
        if self.observer is not None:
            self.observer.step(record, self.engine, counts)
        for order in answered:
            order.resolve()

    def _settle(self) -> None:
        """Hand every request that ended to its reader: a completion's end to its output (and the engine
        forgets it); a session's step call resolves, and its held pages go back to the pool."""
        requests = self.engine.requests
        for seq_id in [s for s, _ in self.outputs.items() if requests[s].done]:
            request = requests[seq_id]
            self.engine.forget(seq_id)
            self._observe("finished", seq_id)
            self._outbox.append((self.outputs.pop(seq_id), ("end", request.stop_reason, request.error,
                                                            len(request.generated), request.prefix_hit_tokens,
                                                            request.prompt_scores)))
        for seq_id in [s for s, order in self.orders.items() if order.session.request.done]:
            order = self.orders.pop(seq_id)
            self.engine.release(seq_id)
            self._observe("finished", seq_id)
            if order.session.request.stop_reason == "error":
                order.resolve(_internal(order.session.request.error))
            else:
                order.resolve()

    def _refuse(self, error: CacheFullError) -> None:
        active = [r for r in self.engine.scheduler.running if not r.paused]
        victims = active if len(active) == 1 else list(self.engine.scheduler.waiting)[:1]
        for request in victims:
            request.error = str(error)
            self._end(request.seq_id, "cache_full")

    def _fail(self, error: Exception) -> None:
        for request in [r for r in self.engine.scheduler.running if not r.paused]:
            request.error = f"{type(error).__name__}: {error}"
            try:
                self._end(request.seq_id, "error")
            except Exception:  # noqa: BLE001 - its pages are beyond repair; the request is ended anyway
                log.exception("could not free request %d", request.seq_id)
                request.stop_reason = "error"

    def _end(self, seq_id: int, reason: str) -> None:
        """End a request now, and the parallel samples still waiting for its prompt (they would wait forever)."""
        request = self.engine.requests.get(seq_id)
        if request is None or request.done:
            return
        children, request.children = list(request.children), []
        self.engine.cancel(seq_id, reason)
        for child in children:
            self._end(child, reason)

    def _abort_everything(self) -> None:
        with self._wake:
            self._stopping = True
            pending = list(self._inbox)
            self._inbox.clear()
        for _, _, future in pending:
            future.set_exception(RuntimeError("the engine has stopped"))
        try:
            live = [s for s, r in self.engine.requests.items() if not r.done]
            self.cancel(live, "abort")
            self._settle()
        finally:
            self._hand_over()
            self.engine.close()

    def _observe(self, what: str, *args) -> None:
        if self.observer is not None:
            getattr(self.observer, what)(self.engine, *args)


def _internal(error: str) -> ApiError:
    return ApiError(500, f"internal error: {error}", code="internal_error")

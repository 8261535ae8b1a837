"""Decoding and attention run in worker threads, a bounded number at a time (--workers), so the event
loop keeps answering /healthz and /metrics while sessions decode."""

from __future__ import annotations

import functools

from anyio import to_thread


async def in_worker(request, function, *args):
    """function(*args) in a worker thread. Not cancellable: a client that goes away mid-step leaves the
    step to finish, so the session's lock is held until its state is whole again."""
    return await to_thread.run_sync(functools.partial(function, *args), limiter=request.app.state.limiter)

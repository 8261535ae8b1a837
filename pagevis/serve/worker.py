"""Decoding and attention run in worker threads, a bounded number at a time (--workers), so the event
loop keeps answering /healthz and /metrics while sessions decode."""

from __future__ import annotations

import functools
import logging

from anyio import to_thread
from fastapi.exceptions import RequestValidationError

from ..engine import ConfigError
from .errors import ApiError

log = logging.getLogger("pagevis.serve")
ANSWERED = (ApiError, ConfigError, RequestValidationError)  # errors with their own 4xx handler


async def in_worker(request, function, *args):
    """function(*args) in a worker thread. Not cancellable: a client that goes away mid-step leaves the
    step to finish, so the session's lock is held until its state is whole again. An unexpected error
    (a bug) becomes a JSON 500 here, logged with its traceback, and the connection stays usable."""
    try:
        return await to_thread.run_sync(functools.partial(function, *args), limiter=request.app.state.limiter)
    except ANSWERED:
        raise
    except Exception as error:
        log.exception("%s %s failed", request.method, request.url.path)
        raise ApiError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error") from error

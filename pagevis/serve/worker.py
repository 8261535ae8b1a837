"""Work that would hold up the event loop runs in worker threads, a bounded number at a time (--workers):
/v1/attention, encoding a long prompt, building a session, encoding a session's step answer. Decoding itself
runs on the engines' own threads (core.py)."""

from __future__ import annotations

import functools

from anyio import to_thread
from fastapi.exceptions import RequestValidationError

from pagevis.kvcache import ConfigError
from pagevis.model.chat_template import ChatTemplateError
from pagevis.serve.errors import ApiError, server_fault

ANSWERED = (ApiError, ConfigError, RequestValidationError, ChatTemplateError)  # errors with their own 4xx handler


async def in_worker(request, function, *args):
    """function(*args) in a worker thread. Not cancellable: a client that goes away leaves the work to
    finish, so a session's lock is held until its state is whole again. An unexpected error
    (a bug) becomes a JSON 500 here, logged with its traceback, and the connection stays usable."""
    try:
        return await to_thread.run_sync(functools.partial(function, *args), limiter=request.app.state.limiter)
    except ANSWERED:
        raise
    except Exception as error:
        raise server_fault(request, error) from error

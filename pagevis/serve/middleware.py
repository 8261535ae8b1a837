"""ASGI middleware: a request-body limit enforced before anything parses the body, and HTTP request
counting by route template (never the raw path, so ids and probes do not make new time series)."""

from __future__ import annotations

import json
import time

from prometheus_client import Counter, Histogram
from starlette.routing import Match

from pagevis.serve.errors import error_body


HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DISCARD_BYTES = 64 << 20  # of an oversized body, read and dropped before the 413 so that the client sees it


class BodyLimit:
    """Answer 413 to a body over `max_bytes`. The body is read here (at most max_bytes of it are kept) and
    handed on. An oversized body is read to its end and dropped before the answer, as long as it is at most
    `discard_bytes` long (Content-Length says so, or the chunks add up): a client still sending when the
    server answers and closes would see its connection reset, not the 413. A longer one is answered at once
    (and the connection closed), which such a client may see as a reset."""

    def __init__(self, app, max_bytes: int, discard_bytes: int = DISCARD_BYTES) -> None:
        self.app, self.max_bytes, self.discard_bytes = app, max_bytes, discard_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= self.discard_bytes and not await self._discard(receive, 0, True):
                return
            await self._too_large(send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                more = message.get("more_body", False)
                if not await self._discard(receive, size, more):
                    return
                await self._too_large(send, size, more)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _discard(self, receive, size: int, more: bool) -> bool:
        """Read the rest of the body, up to discard_bytes in all; False if the client went away."""
        while more and size <= self.discard_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        return True

    async def _too_large(self, send, size: int, more: bool = False) -> None:
        message = (f"request body of {size} bytes{' or more' if more else ''} is over the limit of "
                   f"{self.max_bytes} bytes (pagevis serve --max-body)")
        payload = json.dumps(error_body(413, message, code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestCounter:
    """pagevis_http_requests_total{route, method, status}: route is the matched template
    (e.g. /v1/sessions/{session_id}/step), or "unmatched" (no route, or refused before routing)."""

    def __init__(self, app, router, registry) -> None:
        self.app, self.router = app, router
        self.requests = Counter("pagevis_http_requests", "HTTP requests answered, by route template, method and "
                                "status", ["route", "method", "status"], registry=registry)
        self.seconds = Histogram("pagevis_http_request_duration_seconds", "Seconds from a request's arrival to "
                                 "its answer's end (a stream's whole length), by route template", ["route"],
                                 buckets=HTTP_BUCKETS, registry=registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = self._route(scope)
            self.requests.labels(route, scope["method"], str(status)).inc()
            self.seconds.labels(route).observe(time.perf_counter() - started)

    def _route(self, scope) -> str:
        """The template routing matched (Starlette leaves the route in the scope); for a request answered
        before routing (a 413), the app's own top-level route that matches; else "unmatched"."""
        path = getattr(scope.get("route"), "path", None)
        if path:
            return path
        for route in self.router.routes:
            if getattr(route, "path", None) and route.matches(scope)[0] is not Match.NONE:
                return route.path
        return "unmatched"

"""ASGI middleware in front of the routes: what is refused before a handler runs.

- ``HostGuard``: on a loopback bind, a request whose ``Host`` is not a loopback name is refused (403). A web page
  the user visits can point its own DNS name at 127.0.0.1 (DNS rebinding) and then read the answers as same-origin;
  the name it must send in ``Host`` is its own, so refusing it is the defence Jupyter and others use.
- ``BodyGuard``: a POST body must be ``application/json`` (415: a page elsewhere can send ``text/plain`` without
  asking the browser first, but not JSON), at most ``max_body_bytes`` (413, from ``Content-Length`` before reading
  or while reading) and sent within ``body_timeout`` seconds (408), at ``min_body_rate`` bytes per second on average
  after its first ``BODY_RATE_GRACE`` seconds (408). At most ``max_body_connections`` requests send their bodies at
  once (503 beyond): a slow sender holds a slot of its own kind, never the ones requests being served and
  ``/health`` need. The body is read here, once, and handed on.

CORS (``--cors-origin``) is Starlette's ``CORSMiddleware``, between the two; no origin is allowed by default.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from .options import ServeOptions, is_loopback

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
BODY_RATE_GRACE = 1.0  # seconds a body may take before the minimum rate applies (a client's first round trips)


async def refuse(send: Send, status: int, message: str, *, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
    """Answer OpenAI's error object with ``status`` and close the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostGuard:
    def __init__(self, app: ASGIApp, options: ServeOptions) -> None:
        self.app, self.host = app, options.host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if host is not None and not is_loopback(host_name(host)):
                await refuse(send, 403, f"the Host header {host!r} is not a loopback name: this server is bound to "
                                        f"{self.host} and serves only localhost, 127.0.0.1 and ::1 (to serve other "
                                        f"names, bind another address with --host)", code="host_not_allowed")
                return
        await self.app(scope, receive, send)


class BodyGuard:
    def __init__(self, app: ASGIApp, options: ServeOptions) -> None:
        self.app, self.limit, self.timeout = app, options.max_body_bytes, options.body_timeout
        self.rate, self.slots, self.reading = options.min_body_rate, options.max_body_connections, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if kind != "application/json":
            await refuse(send, 415, f"the request body must be JSON sent as Content-Type: application/json, got "
                                    f"{kind or 'no Content-Type'}", code="unsupported_media_type")
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            await refuse(send, 413, self._too_large(int(length)), code="body_too_large")
            return
        if self.reading >= self.slots:
            await refuse(send, 503, f"{self.reading} requests are sending their bodies, the most this server takes "
                                    f"at once (--max-body-connections); retry later", code="too_many_uploads",
                         headers={"Retry-After": "1"})
            return
        self.reading += 1
        try:
            body = await self._read(receive, send)
        finally:
            self.reading -= 1
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> str:
        return f"the request body has {size} bytes or more; this server takes at most {self.limit} (--max-body-bytes)"

    async def _read(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413/408 (or when the client left)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.timeout
        chunks, size = [], 0
        while True:
            # the next bytes are due when the body so far falls below the minimum rate (or at the deadline)
            due = min(deadline, start + BODY_RATE_GRACE + size / self.rate) if self.rate else deadline
            try:
                message = await asyncio.wait_for(receive(), max(0.0, due - loop.time()))
            except asyncio.TimeoutError:
                why = (f"arrived slower than {self.rate} bytes/s ({size} bytes in {loop.time() - start:.1f} s, "
                       f"--min-body-rate)" if due < deadline else
                       f"did not arrive within {self.timeout:g} s (--body-timeout)")
                await refuse(send, 408, f"the request body {why}", code="request_timeout")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await refuse(send, 413, self._too_large(size), code="body_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

"""Running the app with uvicorn: in the foreground (``tinygpt serve``) or on a background thread (tests,
benchmarks, notebooks).

What uvicorn's own settings give is used (``serving.options`` names them); what they do not give is here:

- a header timeout: uvicorn times out only idle keep-alive connections, so one that never finishes its request
  head held a descriptor forever. ``_Protocol`` answers 408 and closes it after ``header_timeout`` seconds.
- a connection limit at accept: uvicorn's ``limit_concurrency`` answers 503 only once a request head has arrived,
  so half-open connections could still use up the file descriptors. Past ``max_connections``, ``_Protocol`` closes
  the connection that has waited longest for a request head (408) to make room for the new one, and answers 503
  only when every connection is being served: a flood of half-open connections evicts its own, and ``/health``
  still gets through.
- a write timeout: a client that does not read its answer keeps it in the server's memory (the transport buffers
  what the socket cannot take). Once the buffer is past its high-water mark, the client has ``write_timeout``
  seconds to read it down again, or the connection is aborted and the buffer freed.
- running out of file descriptors anyway (another process, a limit set below ``max_connections``): asyncio logs
  every failed ``accept`` (once a second) with a traceback; ``_AcceptErrors`` logs it once, then at most once a
  minute.
- shutdown on SIGTERM / SIGINT: stop accepting, let the in-flight requests finish for up to ``shutdown_timeout``
  seconds, then end every request still open with an error (a stream gets an error event and ``[DONE]``, so its
  body stays well-formed), then the app's lifespan stops the engine. A second signal exits at once (code 128 +
  the signal's number, as a shell reports a killed process).

uvicorn re-raises the signal it caught once it is done (so that a default handler would end the process with it);
``run_server`` installs handlers that only note it, so the command ends with exit code 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .options import ServeOptions

logger = logging.getLogger("uvicorn.error")
ACCEPT_BACKLOG = 64  # the listen backlog, which is also how many connections asyncio accepts in one go
ABORT_GRACE_SECONDS = 2.0  # after the shutdown timeout: time for the aborted streams to send their last events


def _plain_response(status: int, reason: str, message: str) -> bytes:
    body = ('{"error": {"message": "%s", "type": "server_error", "param": null, "code": null}}' % message).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection limit at accept (see the module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        options: ServeOptions = self.config.tinygpt_options  # type: ignore[attr-defined]
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = self.loop.time()  # waiting for a request head since (None: serving one)
        self._answered = False  # a response went out: an idle keep-alive connection is closed without a word
        self._write_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > options.max_connections and not self._evict_idle():
            transport.write(_plain_response(503, "Service Unavailable", f"too many connections (more than "
                                            f"{options.max_connections}, --max-connections); retry later"))
            transport.close()
            return
        self._arm_header_timer()

    def _evict_idle(self) -> bool:
        """Make room by closing the connection that has waited longest for a request head (a half-open one, or an
        idle keep-alive one), never one being served: a flood of half-open connections only evicts its own."""
        idle = [c for c in self.connections if c is not self and isinstance(c, _Protocol) and c._waiting_for_head()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        oldest._close_idle(f"closed to make room for a new connection (--max-connections "
                           f"{self.config.tinygpt_options.max_connections})")  # type: ignore[attr-defined]
        self.connections.discard(oldest)
        return True

    def _waiting_for_head(self) -> bool:
        """No request is being served: the connection is new, idle after a response, or part-way through a head."""
        serving = self.cycle is not None and not self.cycle.response_complete
        return not serving and self._idle_since is not None and not self.transport.is_closing()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._idle_since = self.loop.time()
        timeout = self.config.tinygpt_options.header_timeout  # type: ignore[attr-defined]
        self._header_timer = self.loop.call_later(timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self._waiting_for_head():
            return  # a request is being served: the body timeout (serving.edge) is the app's
        timeout = self.config.tinygpt_options.header_timeout  # type: ignore[attr-defined]
        self._close_idle(f"the request head did not arrive within {timeout:g} s (--header-timeout)")

    def _close_idle(self, message: str) -> None:
        """408 and close (a keep-alive connection that was answered before is closed without one, as uvicorn's
        keep-alive timeout does: a client could take the 408 for the answer to its next request)."""
        self._cancel_header_timer()
        self._idle_since = None
        if not self.transport.is_closing():
            if self.conn.our_state is h11.IDLE and not self._answered:
                self.transport.write(_plain_response(408, "Request Timeout", message))
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_header_timer()  # a request head arrived
            self._idle_since = None

    def on_response_complete(self) -> None:
        self._answered = True
        super().on_response_complete()  # may start a pipelined request already
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # the next request's head gets the same time

    def pause_writing(self) -> None:
        """The send buffer is past its high-water mark: the client has ``write_timeout`` seconds to drain it."""
        super().pause_writing()
        if self._write_timer is None:
            timeout = self.config.tinygpt_options.write_timeout  # type: ignore[attr-defined]
            self._write_timer = self.loop.call_later(timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if getattr(self, "_write_timer", None) is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        timeout = self.config.tinygpt_options.write_timeout  # type: ignore[attr-defined]
        logger.warning("a client left its answer unread for %g s (--write-timeout): connection closed", timeout)
        self.transport.abort()  # drops what is buffered; the handler's next send finds the client gone

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_write_timer()
        self._cancel_header_timer()
        self._idle_since = None
        super().connection_lost(exc)


class _AcceptErrors:
    """asyncio's "socket.accept() out of system resource" (one a second while it lasts, each with a traceback)
    logged once, then at most once every ``INTERVAL`` seconds with the count of the ones not shown."""

    INTERVAL = 60.0
    last: float | None = None
    hidden = 0

    @classmethod
    def handler(cls, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if cls.last is not None and now - cls.last < cls.INTERVAL:
            cls.hidden += 1
            return
        more = f"; {cls.hidden} more since the last message" if cls.hidden else ""
        cls.last, cls.hidden = now, 0
        logger.error("cannot accept connections: %s (out of file descriptors?); new connections wait until some "
                     "close. Raise `ulimit -n` or lower --max-connections (logged at most once a minute%s)",
                     context.get("exception"), more)


class _Server(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring; ``abort`` ends the app's requests."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float, abort: Callable[[], Any] | None) -> None:
        super().__init__(config)
        self.drain_timeout, self.abort = drain_timeout, abort

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(_AcceptErrors.handler)
        await super().startup(sockets=sockets)

    async def _wait_tasks_to_complete(self) -> None:
        try:
            await asyncio.wait_for(super()._wait_tasks_to_complete(), self.drain_timeout)
        except asyncio.TimeoutError:
            if self.abort is not None:
                count = self.abort()
                logger.warning("shutdown timeout: ending %d request(s) still in flight with an error", count)
            await super()._wait_tasks_to_complete()  # bounded by uvicorn's timeout_graceful_shutdown

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            print(f"tinygpt serve: second {signal.Signals(sig).name}: exiting at once", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        super().handle_exit(sig, frame)


def _server(app: Any, options: ServeOptions) -> _Server:
    # limit_concurrency one above max_connections: _Protocol has made room (or refused) by the time a head arrives.
    # loop="asyncio", not uvicorn's "auto" (uvloop when installed, as ray[serve] installs it): the accept-error
    # handler and the write timeouts above are asyncio's, and uvloop reports running out of descriptors otherwise
    config = uvicorn.Config(
        app, log_level=options.log_level, lifespan="on", http=_Protocol, loop="asyncio",
        timeout_graceful_shutdown=int(options.shutdown_timeout + ABORT_GRACE_SECONDS + 0.999),
        timeout_keep_alive=options.keep_alive_timeout, limit_concurrency=options.max_connections + 1,
        h11_max_incomplete_event_size=options.max_header_bytes, backlog=ACCEPT_BACKLOG)
    config.tinygpt_options = options  # type: ignore[attr-defined]  # read by _Protocol
    state = getattr(getattr(app, "state", None), "tinygpt", None)
    return _Server(config, options.shutdown_timeout, None if state is None else state.abort_all)


def _options_of(app: Any) -> ServeOptions:
    state = getattr(getattr(app, "state", None), "tinygpt", None)
    return state.options if state is not None else ServeOptions()


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket, or a ``ValueError`` saying why not (uvicorn would log it and exit with code 3)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def run_server(app: Any, options: ServeOptions | None = None, *,
               announce: Callable[[str], None] | None = None) -> list[int]:
    """Serve until SIGTERM or SIGINT; returns the signals received (the caller exits 0 after a clean stop).
    ``options``: the app's own (``create_app``'s) by default. ``announce`` gets the server's URL once the address is
    bound (an address in use is a ``ValueError``)."""
    options = options or _options_of(app)
    sock = _listen(options.host, options.port)
    url = f"http://{options.host}:{sock.getsockname()[1]}"
    server = _server(app, options)
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        # before uvicorn's own handlers are in (its serve() installs them) a signal must still stop the server;
        # after, uvicorn re-raises the signals it caught once it is done, and they land here only to be noted
        received.append(signum)
        server.should_exit = True

    # the handlers go in before the URL is announced: a client (or a supervisor) may signal as soon as it reads it
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if announce is not None:
            announce(url)
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received


class BackgroundServer:
    """``with BackgroundServer(app) as server:`` serves on 127.0.0.1 at a free port (``server.url``) from a
    thread, and stops it on exit (the app's lifespan stops its engine). The app's options apply (timeouts,
    limits); ``shutdown_timeout`` overrides theirs."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", shutdown_timeout: float | None = None,
                 start_timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        options = _options_of(app)
        options = ServeOptions(**{**vars(options), "log_level": "warning", "shutdown_timeout": (
            options.shutdown_timeout if shutdown_timeout is None else shutdown_timeout)})
        self.server = _server(app, options)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

"""Running the app with uvicorn: in the foreground (``tinygpt serve``) or on a background thread (tests,
benchmarks, notebooks).

Shutdown on SIGTERM / SIGINT is uvicorn's: stop accepting connections, let the in-flight requests finish for up to
``shutdown_timeout`` seconds, cancel what is left, then the app's lifespan stops the engine. uvicorn re-raises the
signal it caught once it is done (so that a default handler would end the process with it); ``run_server``
installs handlers that only note it, so the command ends with exit code 0.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any, Callable

import uvicorn


def _config(app: Any, shutdown_timeout: float, log_level: str, **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                          **kwargs)


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


def run_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 10.0,
               log_level: str = "info", announce: Callable[[str], None] | None = None) -> list[int]:
    """Serve until SIGTERM or SIGINT; returns the signals received (the caller exits 0 after a clean stop).
    ``announce`` gets the server's URL once the address is bound (an address in use is a ``ValueError``)."""
    sock = _listen(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    if announce is not None:
        announce(url)
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = uvicorn.Server(_config(app, shutdown_timeout, log_level))
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received


class BackgroundServer:
    """``with BackgroundServer(app) as server:`` serves on 127.0.0.1 at a free port (``server.url``) from a
    thread, and stops it on exit (the app's lifespan stops its engine)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", shutdown_timeout: float = 5.0,
                 start_timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(_config(app, shutdown_timeout, "warning"))
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

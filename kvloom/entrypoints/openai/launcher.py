"""Serving the app over HTTP with a bounded drain.

On SIGTERM uvicorn stops accepting connections and lets the in-flight responses finish for at
most ``--shutdown-timeout`` seconds; then the engine is stopped, which ends the remaining streams
with an error event. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from kvloom.engine.engine_client import EngineClient

if TYPE_CHECKING:
    from kvloom.entrypoints.openai.served_models import ServedModels

logger = logging.getLogger("kvloom")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the port before the model loads, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded drain: the first SIGTERM / SIGINT stops accepting and
    lets in-flight requests finish for ``shutdown_timeout`` seconds, then stops the engine,
    which ends the remaining requests with an error (a stream's last event); a second signal
    of either kind exits at once (uvicorn alone forces only on a second SIGINT)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient | ServedModels, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self._captured_signals.append(sig)
            self.force_exit = True
            return
        super().handle_exit(sig, frame)
        logger.info("Shutting down: in-flight requests have %.0fs to finish (--shutdown-timeout)",
                    self.shutdown_timeout)
        self._deadline = threading.Timer(self.shutdown_timeout, self._end_requests)
        self._deadline.daemon = True
        self._deadline.start()

    def cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()

    def _end_requests(self) -> None:
        if self.engine.has_requests():
            logger.warning("Shutdown timeout of %.0fs reached: ending the requests still running",
                           self.shutdown_timeout)
        self.engine.shutdown(reason=f"the server is shutting down: the request did not finish within "
                             f"--shutdown-timeout ({self.shutdown_timeout:g}s)")


def serve_http(app: FastAPI, sock: socket.socket, engine: EngineClient | ServedModels, *, log_level: str,
               access_log: bool, shutdown_timeout: float) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGTERM / SIGINT and the drain are over (the
    caller then stops ``engine``: one engine, or every loaded model's)."""
    # uvicorn's own deadline is a backstop: by then the engine has ended every stream.
    server = DrainingServer(uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_keep_alive=5,
                                           timeout_graceful_shutdown=shutdown_timeout + 1),
                            engine, shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers make
    # that a clean exit (the engine thread is stopped by the caller) instead of a kill.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: received.append(s))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        server.cancel_deadline()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""Running the app under uvicorn, with the shutdown behaviour of ``specdial serve``.

On SIGTERM or SIGINT (:meth:`SpecdialServer.handle_exit`): the app stops admitting at once
(generation requests and ``/health`` answer 503), uvicorn closes the listening socket and lets
the running requests finish for up to ``shutdown_timeout`` seconds, then cancels what is left
(which aborts those engine requests), and the app's lifespan shutdown calls
``engine.shutdown(drain=False)``. :func:`serve_forever` then returns normally, so the process
exits with status 0.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

__all__ = ["SpecdialServer", "make_server", "serve_forever"]


class SpecdialServer(uvicorn.Server):
    """``uvicorn.Server`` that marks the app as draining as soon as an exit is requested."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (also callable directly, e.g. from a test thread): stop admitting,
        then let uvicorn shut down gracefully."""
        self.app.state.specdial.begin_drain()
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 30000,
                log_level: str = "info", shutdown_timeout: float = 30.0,
                access_log: bool = True) -> SpecdialServer:
    """A server for ``app`` (from :func:`specdial.server.create_app`); ``shutdown_timeout`` in
    seconds bounds the graceful drain."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            # annotated int, used as asyncio.wait_for's timeout: floats work
                            timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
                            access_log=access_log)
    return SpecdialServer(config, app)


def serve_forever(server: SpecdialServer, sockets: list[socket.socket] | None = None) -> int:
    """Run ``server`` until SIGTERM/SIGINT; returns the exit status: 0 after a graceful
    shutdown, 1 when uvicorn could not start (e.g. the port is taken).

    uvicorn re-raises the captured signal after its shutdown, to the handler that was installed
    before it ran; a no-op handler is installed around the run so that a handled SIGTERM ends
    the process with status 0 instead of being killed by the default action. The engine is
    shut down in any case (:meth:`ServerState.shutdown_engine`, idempotent).
    """
    state = server.app.state.specdial
    handled = (signal.SIGTERM, signal.SIGINT)
    previous: dict[int, Any] = {}
    try:
        try:
            previous = {s: signal.signal(s, lambda *_: None) for s in handled}
        except ValueError:  # not the main thread: uvicorn does not capture signals there either
            previous = {}
        server.run(sockets=sockets)
        return 0
    except SystemExit as e:  # uvicorn exits on startup failures
        return int(e.code) if isinstance(e.code, int) else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        state.begin_drain()
        state.shutdown_engine()

"""Running the app under uvicorn, with the shutdown behaviour of ``specdial serve``.

On SIGTERM or SIGINT (:meth:`SpecdialServer.handle_exit`): the app stops admitting at once
(generation requests and ``/health`` answer 503), uvicorn closes the listening socket and lets
the running requests finish for up to ``shutdown_timeout`` seconds; then the app aborts what is
left (:meth:`ServerState.abort_runs`: every open stream ends with a final event whose
``finish_reason`` is ``abort`` and ``data: [DONE]``, non-streaming requests answer with that
reason), uvicorn waits up to :data:`ABORT_GRACE_S` more seconds for those responses to go out
and cancels whatever is still open, and the app's lifespan shutdown calls
``engine.shutdown(drain=False)``. :func:`serve_forever` then returns normally, so the process
exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from specdial.server.connections import ConnectionLimits, protocol_class

__all__ = ["ABORT_GRACE_S", "SpecdialServer", "make_server", "serve_forever"]

#: Seconds past ``shutdown_timeout`` that aborted responses get to finish before uvicorn
#: cancels them.
ABORT_GRACE_S = 5.0


class SpecdialServer(uvicorn.Server):
    """``uvicorn.Server`` that marks the app as draining as soon as an exit is requested and
    aborts the open requests ``shutdown_timeout`` seconds into the shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI,
                 shutdown_timeout: float = 30.0) -> None:
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with :meth:`ServerState.abort_runs` after ``shutdown_timeout``
        seconds (uvicorn itself cancels :data:`ABORT_GRACE_S` seconds later)."""
        state = self.app.state.specdial
        timer = asyncio.get_running_loop().call_later(
            self.shutdown_timeout, state.abort_runs,
            f"the server is shutting down (--shutdown-timeout {self.shutdown_timeout:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (also callable directly, e.g. from a test thread): stop admitting,
        then let uvicorn shut down gracefully."""
        self.app.state.specdial.begin_drain()
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 30000,
                log_level: str = "info", shutdown_timeout: float = 30.0,
                access_log: bool = True,
                connection_limits: ConnectionLimits | None = None) -> SpecdialServer:
    """A server for ``app`` (from :func:`specdial.server.create_app`); ``shutdown_timeout`` in
    seconds bounds the graceful drain (then open requests are aborted). ``connection_limits``
    (default: :class:`ConnectionLimits`' defaults): the header-read timeout and connection cap
    of :mod:`specdial.server.connections`, enforced by the h11 protocol class it installs."""
    grace = shutdown_timeout + ABORT_GRACE_S
    http = protocol_class(connection_limits or ConnectionLimits())
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=http,
                            # annotated int, used as asyncio.wait_for's timeout: floats work
                            timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
                            access_log=access_log)
    return SpecdialServer(config, app, shutdown_timeout)


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

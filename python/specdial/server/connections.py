"""Connection-level limits of ``specdial serve``: a header-read timeout and a connection cap.

uvicorn has no timeout on reading a request's headers: its keep-alive timeout only runs between
requests, and the first byte a client sends cancels it, so a client that opens a connection and
sends its headers one byte at a time (slowloris) holds the connection, and its file descriptor,
for ever. Nor does it have a connection cap that spares health probes (its
``limit_concurrency`` answers 503 to every path, ``/health`` included).

Both are enforced here at the protocol level, in :class:`GuardedH11Protocol`, a subclass of
uvicorn's own h11 protocol (``uvicorn.Config(http=...)`` takes a protocol class), rather than by
another ASGI server: the server's shutdown and drain behaviour (:mod:`specdial.server.launch`)
is built on ``uvicorn.Server``, and the two guards need only three hooks of the protocol
(connection made, request headers parsed, response complete). h11 is the protocol uvicorn uses
without the optional ``httptools``; pinning it keeps one code path for every installation.

- Header-read timeout (``--header-read-timeout``, seconds, default 30, as nginx's
  ``client_header_timeout`` and Apache's ``RequestReadTimeout header=``): from the moment a
  connection opens, or its previous response completes, the client has that long to finish the
  next request's headers. Otherwise the server writes ``408 Request Timeout`` and closes the
  connection. The body has its own limit (``--body-read-timeout``,
  :class:`specdial.server.limits.BodyLimitMiddleware`).
- Connection cap (``--max-connections``, default 1000): every open connection counts, including
  those still sending their headers, so slow clients fill the cap too. A request that arrives
  on a connection beyond the cap is answered at once with 503 ``too_many_connections`` and
  ``Connection: close``, before any route, body read or engine work; ``/health`` and
  ``/metrics`` (:data:`EXEMPT_PATHS`) are exempt so that probes still answer while the cap is
  full (as ``/health`` is open without the API key). Connections beyond the cap are still
  accepted (a probe must be able to connect) and the header-read timeout closes the slow ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdial.server.defaults import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from specdial.server.protocol import APIError, send_api_error

__all__ = ["DEFAULT_HEADER_READ_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "EXEMPT_PATHS",
           "ConnectionLimits", "GuardedH11Protocol", "protocol_class"]

logger = logging.getLogger("specdial.server")

#: Paths answered even when the connection cap is full (health probes, metric scrapers).
EXEMPT_PATHS = frozenset({"/health", "/metrics", "/ping"})

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 45\r\nConnection: close\r\n\r\n"
                b"request headers not received in time (408)\r\n\r\n")


class ConnectionLimits:
    """The two limits of the module docstring.

    ``header_read_timeout_s``: seconds (finite, > 0) a connection has to send complete request
    headers. ``max_connections``: open connections (>= 1) beyond which non-exempt requests get
    503; None: no cap. Raises ``ValueError`` naming the ``specdial serve`` option."""

    def __init__(self, header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S,
                 max_connections: int | None = DEFAULT_MAX_CONNECTIONS) -> None:
        t = header_read_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                t > 0 and math.isfinite(t)):
            raise ValueError(f"--header-read-timeout must be a finite number of seconds > 0, "
                             f"got {t!r}")
        m = max_connections
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"--max-connections must be an integer >= 1, got {m!r}")
        self.header_read_timeout_s = float(t)
        self.max_connections = m


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header-read timeout and the connection cap (module
    docstring). Configured by the class attribute ``limits`` (see :func:`protocol_class`)."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        if self.limits.max_connections is not None:
            self.app = _CapApp(self.app, self)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # h11 leaves IDLE once a request's headers are parsed (SEND_BODY, then DONE)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers, on a kept-alive connection
            if self.conn.their_state is not h11.IDLE:  # a pipelined request was parsed already
                self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_read_timeout_s,
                                                  self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.info("%s: request headers not complete after %g s (--header-read-timeout); "
                    "connection closed (408)", _peer(self.client),
                    self.limits.header_read_timeout_s)
        self.transport.write(_TIMEOUT_408)
        self.transport.close()


class _CapApp:
    """Answers 503 to a non-exempt request while more than ``max_connections`` are open."""

    def __init__(self, app: ASGIApp, protocol: GuardedH11Protocol) -> None:
        self.app, self.protocol = app, protocol

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cap = self.protocol.limits.max_connections
        open_now = len(self.protocol.connections)
        if (scope["type"] == "http" and cap is not None and open_now > cap
                and scope["path"] not in EXEMPT_PATHS):
            await send_api_error(scope, receive, send, APIError(
                503, f"The server has {open_now} open connections, more than its limit of {cap} "
                "(--max-connections); retry later", type="server_overloaded",
                code="too_many_connections"), {"Connection": "close"})
            return
        await self.app(scope, receive, send)


def _peer(client: Any) -> str:
    return "%s:%d" % client if client else "a client"


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass enforcing ``limits`` (for ``uvicorn.Config``'s
    ``http``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})

"""Who may call the server: API key, Host check (DNS rebinding), CORS, JSON content type.

:class:`SecurityMiddleware` (ASGI) checks, in this order, before any route runs:

1. ``Host``: with ``allowed_hosts`` set, the Host header's name (port and IPv6 brackets
   stripped, case-insensitive) must be one of them, else 400 ``invalid_host``. This defeats DNS
   rebinding, where a web page's own name is re-pointed at 127.0.0.1 so that the browser sends
   it requests carrying a foreign Host. ``specdial serve`` defaults to the loopback names when it
   is bound to a loopback address (:func:`default_allowed_hosts`).
2. CORS (Starlette's ``CORSMiddleware``) when ``allowed_origins`` is set: preflights of those
   origins are answered, responses carry ``Access-Control-Allow-Origin``; with none (the
   default) no CORS header is sent, so browsers let no other site read a response.
3. ``api_key``: every path except ``/health``, ``/metrics``, vLLM's ``/ping`` and SGLang's
   ``/health_generate`` (open, as in vLLM and SGLang, for probes and scrapers) needs ``Authorization: Bearer <key>``, else 401 ``invalid_api_key`` with
   ``WWW-Authenticate: Bearer``. The comparison is constant-time (``hmac.compare_digest`` of
   SHA-256 digests, so neither the content nor the length of the key leaks through timing).
   The key comes from ``--api-key`` or ``SPECDIAL_API_KEY`` (as vLLM's ``--api-key`` and
   ``VLLM_API_KEY``, SGLang's ``--api-key``).
4. Request bodies (POST, PUT, PATCH) must be ``Content-Type: application/json``, else 415
   ``unsupported_media_type``: a cross-site form or ``text/plain`` POST, which browsers send
   without a CORS preflight, never reaches a route. ``/flush_cache`` reads no body and its
   ``GET`` does the same as its ``POST``, so its ``POST`` takes any content type (SGLang's
   clients send none; :data:`BODYLESS_PATHS`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass
from typing import Iterable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from specdial.server.protocol import APIError, send_api_error

__all__ = ["OPEN_PATHS", "SecurityConfig", "SecurityMiddleware", "default_allowed_hosts",
           "parse_name_list"]

#: Paths answered without an API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/health_generate"})
#: Host names allowed by default when the server listens on a loopback address.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: Paths whose POST reads no body: no content type is required.
BODYLESS_PATHS = frozenset({"/flush_cache", "/ping"})


@dataclass(frozen=True)
class SecurityConfig:
    """The checks of :class:`SecurityMiddleware`.

    - ``api_key``: None (default): no authentication; else the key (non-empty).
    - ``allowed_hosts``: None: any Host; else the allowed host names (lower case; ``"*"``
      allows any).
    - ``allowed_origins``: origins (``scheme://host[:port]``) allowed by CORS; ``"*"`` any;
      empty (default): no CORS.

    Raises ``ValueError`` naming the ``specdial serve`` option for an empty key or an empty
    ``allowed_hosts``.
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key (or SPECDIAL_API_KEY) must not be empty")
        if self.allowed_hosts is not None:
            if not self.allowed_hosts:
                raise ValueError("--allowed-hosts must name at least one host (or '*')")
            object.__setattr__(self, "allowed_hosts",
                               tuple(h.lower().rstrip(".") for h in self.allowed_hosts))


def parse_name_list(text: str | None) -> tuple[str, ...] | None:
    """An option value as a tuple of stripped names: comma-separated, or a JSON list of strings
    (vLLM's ``--allowed-origins '["*"]'`` form). None stays None. Raises ``ValueError`` for a
    JSON list that is not a list of strings."""
    if text is None:
        return None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list of names: {text!r} ({e})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"not a JSON list of names: {text!r}")
        return tuple(i.strip() for i in items if i.strip())
    return tuple(part.strip() for part in text.split(",") if part.strip())


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """The loopback names (plus ``bind_host``) when ``bind_host`` is a loopback address or
    ``localhost``; None (any Host) otherwise, e.g. ``0.0.0.0``, where the names clients use
    are not known."""
    name = bind_host.strip("[]").lower()
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, name))) if loopback else None


def _host_name(value: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``; lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class _Guard:
    """API key and content type (steps 3 and 4 of the module docstring)."""

    def __init__(self, app: ASGIApp, config: SecurityConfig) -> None:
        self.app = app
        self.key_digest = None if config.api_key is None else _digest(config.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
                await send_api_error(scope, receive, send, error, headers)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        if self.key_digest is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else ""
            if not (hmac.compare_digest(_digest(given), self.key_digest) and given):
                return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                "<key>'", type="invalid_request_error", code="invalid_api_key")
        if scope["method"] in _BODY_METHODS and scope["path"] not in BODYLESS_PATHS:
            media = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return APIError(415, f"Content-Type must be application/json, got "
                                f"{media or 'none'}", code="unsupported_media_type")
        return None


class SecurityMiddleware:
    """The checks of the module docstring, configured by a :class:`SecurityConfig`."""

    def __init__(self, app: ASGIApp, config: SecurityConfig) -> None:
        inner: ASGIApp = _Guard(app, config)
        if config.allowed_origins:
            inner = CORSMiddleware(inner, allow_origins=list(config.allowed_origins),
                                   allow_methods=["GET", "POST", "OPTIONS"],
                                   allow_headers=["Authorization", "Content-Type"])
        self.inner = inner
        hosts: Iterable[str] | None = config.allowed_hosts
        self.hosts = None if hosts is None or "*" in hosts else frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.hosts is not None:
            host = _header(scope, b"host")
            if host is None or _host_name(host) not in self.hosts:
                await send_api_error(scope, receive, send, APIError(
                    400, f"Host {host!r} is not allowed (--allowed-hosts)",
                    code="invalid_host"))
                return
        await self.inner(scope, receive, send)

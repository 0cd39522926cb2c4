"""Errors -> OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``).

- :func:`engine_error`: an engine exception -> :class:`~specdial.server.protocol.APIError`
  (queue full: 503 with ``Retry-After``; a bad request: 400 naming the field; anything else:
  500 ``internal_error``).
- :func:`api_error_handler`, :func:`http_error_handler`: the app's exception handlers (an
  :class:`APIError`; Starlette's 404 / 405 in the same JSON).
- :class:`InternalErrorMiddleware`: any other exception of a route -> a JSON 500.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specdial.engine.api import QueueFullError, RequestError
from specdial.server.protocol import APIError, bad_request

__all__ = ["InternalErrorMiddleware", "api_error_handler", "engine_error", "http_error_handler"]

logger = logging.getLogger("specdial.server")

# engine-level names (RequestError.param or words of its message) -> OpenAI field
_ENGINE_PARAMS = ("max_new_tokens", "input_ids", "prompt", "temperature", "top_p", "top_k",
                  "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_tokens", "seed", "stop_token_ids", "stop", "logit_bias")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """An :class:`APIError` as its JSON body and status (``Retry-After: 1`` on a full
    queue)."""
    assert isinstance(exc, APIError)
    headers = {"Retry-After": "1"} if exc.code == "queue_full" else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's HTTP errors (unknown route 404, wrong method 405, ...) in the same JSON,
    the status as the ``code``."""
    assert isinstance(exc, StarletteHTTPException)
    err = APIError(exc.status_code, str(exc.detail), code=str(exc.status_code))
    return JSONResponse(err.body(), status_code=exc.status_code)


def engine_error(e: BaseException, params: dict[str, str]) -> APIError:
    """Map an engine exception to an API error; ``params`` maps engine names to OpenAI's."""
    if isinstance(e, QueueFullError):
        # the core's message may already end with "retry later": say it once
        detail = re.sub(r"[\s;,.]*retry later[.!]?\s*$", "", str(e), flags=re.IGNORECASE)
        return APIError(503, f"The server is overloaded ({detail}); retry later",
                        type="server_overloaded", code="queue_full")
    if isinstance(e, RequestError):
        param = getattr(e, "param", None)
        if param is None:  # find the earliest engine field named in the message
            msg = str(e)
            hits = [(msg.find(p), p) for p in _ENGINE_PARAMS if p in msg]
            param = min(hits)[1] if hits else None
        return bad_request(str(e), params.get(param, param) if param else None, "invalid_value")
    logger.error("engine failure", exc_info=e)
    return APIError(500, f"internal engine error: {type(e).__name__}: {e}",
                    type="internal_error", code="internal_error")


class InternalErrorMiddleware:
    """Answer an unexpected exception of a route with a JSON 500 (``{"error": {...}}``, code
    ``internal_error``) instead of Starlette's plain-text one, and without re-raising it, so
    that uvicorn keeps the connection open. An exception after the response started (a
    streaming body) cannot be answered any more and propagates."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - answered as JSON
            if started:
                raise
            logger.error("internal error in %s %s", scope.get("method"), scope.get("path"),
                         exc_info=e)
            err = APIError(500, f"internal server error: {type(e).__name__}: {e}",
                           type="internal_error", code="internal_error")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)

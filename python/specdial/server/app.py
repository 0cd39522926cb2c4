"""The HTTP app (FastAPI) over an engine implementing :mod:`specdial.engine.api`: OpenAI's,
SGLang's and the operational endpoints, each an ``APIRouter`` with module-level handlers:

- :mod:`specdial.server.openai_api`: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``;
- :mod:`specdial.server.sglang_api`: ``/generate``, ``/server_info``, ``/get_model_info``,
  ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/version``;
- :mod:`specdial.server.ops_api`: ``/health`` (200, or 503 while shutting down or once the
  engine reports a fatal failure in its optional ``failure`` attribute, e.g. a tensor-parallel
  rank died; generation requests then get the same 503) and ``/metrics`` (Prometheus,
  :mod:`specdial.server.metrics`).

The routes share one :class:`~specdial.server.state.ServerState` (``app.state.specdial``),
which they receive as a FastAPI dependency (:data:`~specdial.server.state.StateDep`). One HTTP
request's engine requests are a :class:`~specdial.server.runs.Run`; the request -> engine
sampling mapping is :mod:`specdial.server.jobs`.

Before a route runs, :mod:`specdial.server.security` checks the Host, CORS, the API key and the
content type, and :mod:`specdial.server.limits` reads the body (size, read time, JSON depth).
Parsing, limit checks, chat templates and tokenization then run in a one-thread pool
(``ServerState.offload``, as vLLM tokenizes in its own thread), never on the event loop, so one
large request does not stall the others; detokenization happens in the engine's loop thread.

Status codes: 400 invalid request (JSON error naming ``param``), 401 missing or wrong API key,
404 unknown model or route, 408 body not received in time, 413 body too large, 415 not JSON,
503 full queue (with ``Retry-After``) or shutting down, 500 engine failure or any other
unexpected error (also a JSON error, code ``internal_error``; :mod:`specdial.server.errors`).
Finish reasons: ``stop``, ``length``, or ``abort`` (the client's request was aborted, or the
server's shutdown ended it: :meth:`ServerState.abort_runs`). A request the engine *failed* (a
pass raised, a tensor-parallel rank died, the engine loop stopped: finish reason ``error``,
:mod:`specdial.engine.ends`) is never a 200: it is answered 500 with an OpenAI error body naming
the cause (code ``engine_error``), or, once streaming, with an error event
(``data: {"error": {...}}``) and then ``data: [DONE]``. A client that disconnects aborts its
engine requests (streaming: through the cancelled response body; non-streaming: a task waits
for ``http.disconnect`` while the request runs), logged once at INFO with the request id.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdial.server import openai_api, ops_api, sglang_api
from specdial.server.config import BUILTIN_MODEL_NAME
from specdial.server.errors import InternalErrorMiddleware, api_error_handler, http_error_handler
from specdial.server.limits import BodyLimitMiddleware, ServerLimits
from specdial.server.protocol import APIError
from specdial.server.security import SecurityConfig, SecurityMiddleware
from specdial.server.state import ServerState

# ServerState re-exported: read here by tests and launch's callers
__all__ = ["ServerState", "create_app"]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """At shutdown: stop admitting, then shut the engine down (off the event loop)."""
    yield
    state: ServerState = app.state.specdial
    state.begin_drain()
    await asyncio.to_thread(state.shutdown_engine)


def create_app(engine: Any, *, served_model_name: str = BUILTIN_MODEL_NAME,
               shutdown_engine_on_exit: bool = True,
               server_args: dict[str, Any] | None = None, limits: ServerLimits | None = None,
               security: SecurityConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`specdial.engine.api.EngineProtocol`)
    under the model name ``served_model_name``. ``app.state.specdial`` is the
    :class:`ServerState` (``begin_drain()`` makes new requests 503). At lifespan shutdown the
    engine is shut down (``drain=False``) unless ``shutdown_engine_on_exit`` is False.
    ``server_args``: the options the server was started with, reported by ``/server_info``.
    ``limits`` (default: :class:`ServerLimits`' defaults) and ``security`` (default: no key,
    any Host, no CORS; JSON bodies required) configure the checks made before the routes."""
    state = ServerState(engine, served_model_name, shutdown_engine_on_exit, limits)
    state.server_args = dict(server_args or {})
    app = FastAPI(title="specdial", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.specdial = state
    # outermost last: JSON 500s around everything, then Host/CORS/key/type, then the body
    app.add_middleware(BodyLimitMiddleware, limits=state.limits)
    app.add_middleware(SecurityMiddleware, config=security or SecurityConfig())
    app.add_middleware(InternalErrorMiddleware)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    for router in (ops_api.router, openai_api.router, sglang_api.router):
        app.include_router(router)
    return app

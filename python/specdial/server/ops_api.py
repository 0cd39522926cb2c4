"""Operational endpoints (``APIRouter`` :data:`router`): ``GET /health`` (200, or 503 while
shutting down or once the engine reports a fatal failure: ``ServerState.check_admitting``;
vLLM's ``GET``/``POST /ping`` is the same), SGLang's ``GET /health_generate`` (a one-token
generation: 200 once it completes, 503 when it fails or takes longer than
:data:`HEALTH_GENERATE_TIMEOUT_S`), ``GET /metrics`` (Prometheus text,
:mod:`specdial.server.metrics`), SGLang's ``GET``/``POST /flush_cache``
(:mod:`specdial.server.flush`) and SGLang's ``POST /abort_request`` (``{"rid": str}`` or
``{"abort_all": true}``: the ``/generate`` requests with that ``rid``, and the OpenAI
completion and chat requests that carried it as their ``rid`` field (SGLang's OpenAI requests
take one too), end with the abort finish reason and what they generated until then, and their
KV pages are freed; ``abort_all`` ends every open request, whatever its route; 200 with an
empty body, unknown ids included, as SGLang answers)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specdial.engine.ends import is_failure
from specdial.server.flush import flush_cache_response
from specdial.server.metrics import CONTENT_TYPE
from specdial.server.protocol import bad_request
from specdial.server.state import StateDep

__all__ = ["HEALTH_GENERATE_TIMEOUT_S", "router"]

logger = logging.getLogger("specdial.server")

#: Seconds ``/health_generate`` waits for its one-token generation (SGLang's
#: ``SGLANG_HEALTH_CHECK_TIMEOUT`` default: 20).
HEALTH_GENERATE_TIMEOUT_S = 20.0

#: The operational routes.
router = APIRouter()


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    """``{"status": "ok"}``, or the 503 of :meth:`ServerState.check_admitting`; while some
    data-parallel replicas have failed and others serve (the engine's optional ``degraded``),
    200 with ``{"status": "degraded", "message": <which replicas, why>}``."""
    state.check_admitting()
    degraded = getattr(state.engine, "degraded", None)
    if degraded:
        return JSONResponse({"status": "degraded", "message": degraded})
    return JSONResponse({"status": "ok"})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(state: StateDep) -> JSONResponse:
    """vLLM's ``/ping`` (SageMaker's health check): :func:`health`."""
    return await health(state)


@router.get("/health_generate")
async def health_generate(state: StateDep) -> Response:
    """SGLang's ``/health_generate``: runs a one-token greedy generation (prompt: token id 0)
    through the engine and answers 200 (empty body) once it completes; 503 while shutting down
    or after an engine failure (:meth:`ServerState.check_admitting`), when the generation fails
    (queue full, finish reason ``error``) or does not complete within
    :data:`HEALTH_GENERATE_TIMEOUT_S` seconds. The request counts in the engine's statistics
    like any other."""
    state.check_admitting()

    async def one_token() -> bool:
        end = None
        async for chunk in state.engine.async_stream(
                input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}):
            end = chunk
        return end is not None and end.finished and not is_failure(end.finish_reason)

    try:
        ok = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
        logger.warning("health_generate: the one-token generation failed: %r", e)
        ok = False
    return Response(status_code=200 if ok else 503)


@router.post("/abort_request")
async def abort_request(request: Request, state: StateDep) -> Response:
    """SGLang's ``/abort_request`` (module docstring). Raises :class:`APIError` 400 naming
    ``rid`` / ``abort_all`` for a body that is not a JSON object with a string ``rid`` or a
    boolean ``abort_all``."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise bad_request("the body must be a JSON object: {\"rid\": str} or "
                          "{\"abort_all\": true}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object: {\"rid\": str} or "
                          "{\"abort_all\": true}", None, "invalid_value")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise bad_request(f"'abort_all' must be a boolean, got {abort_all!r}", "abort_all",
                          "invalid_value")
    if not isinstance(rid, str) or not (rid or abort_all):
        raise bad_request(f"'rid' must be a non-empty string (the rid of a /generate or an "
                          f"OpenAI request) unless abort_all is true, got {rid!r}", "rid",
                          "invalid_value")
    rids = None if abort_all else {rid}
    message = "aborted by /abort_request" + ("" if abort_all else f" (rid {rid})")
    n = sum(run.abort_jobs(rids, message) for run in list(state.runs))
    logger.info("abort_request %s: %d request(s) aborted", "all" if abort_all else rid, n)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """The Prometheus exposition (rendered off the event loop)."""
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, state: StateDep) -> Response:
    """SGLang's ``/flush_cache`` (:func:`specdial.server.flush.flush_cache_response`)."""
    state.check_admitting()
    return await flush_cache_response(state.engine, request.query_params.get("timeout"))

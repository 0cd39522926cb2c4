"""Operational endpoints (``APIRouter`` :data:`router`): ``GET /health`` (200, or 503 while
shutting down or once the engine reports a fatal failure: ``ServerState.check_admitting``),
``GET /metrics`` (Prometheus text, :mod:`specdial.server.metrics`) and SGLang's
``GET``/``POST /flush_cache`` (:mod:`specdial.server.flush`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specdial.server.flush import flush_cache_response
from specdial.server.metrics import CONTENT_TYPE
from specdial.server.state import StateDep

__all__ = ["router"]

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

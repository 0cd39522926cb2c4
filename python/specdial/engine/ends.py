"""How a request ends: the typed ``finish_reason`` of its last :class:`~specdial.engine.api.StreamChunk`.

Every request ends exactly one of four ways (:func:`end_kind`):

- **finished**: ``{"type": "stop", "matched": token_id_or_str}`` or
  ``{"type": "length", "length": n}`` (SGLang's ``FINISH_MATCHED_*`` / ``FINISH_LENGTH``);
- **aborted** by its client (:meth:`Engine.abort`, a stream left early, a disconnected HTTP
  client): ``{"type": "abort", "message": str, "cause": "client"}`` (SGLang's ``FINISH_ABORT``);
- **shut down**: the engine or server stopped before it finished:
  ``{"type": "abort", "message": str, "cause": "shutdown"}``;
- **failed**: the engine could not run it (a pass raised, a tensor-parallel rank died, the engine
  loop stopped): ``{"type": "error", "message": str, "status_code": 500}``, the message naming
  the cause; ``status_code`` (SGLang's field of ``FINISH_ABORT``) is 503 when the whole engine is
  down, 400 when the request's own content stopped it mid-way (a grammar at a dead end), else
  500. The server answers such a request with that HTTP status and an OpenAI error
  body (:func:`error_body`), never with 200 and empty or truncated text.

Only plain dicts and strings here (no torch), so that front ends and test doubles can import it.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["FAILED", "aborted", "end_kind", "error_body", "failed", "finished", "is_failure",
           "shut_down"]

#: ``finish_reason["type"]`` of a failed request.
FAILED = "error"

EndKind = Literal["finished", "aborted", "shutdown", "failed"]


def finished(matched: str | None, fin: Any) -> dict[str, Any]:
    """The finish reason of a request the scheduler's report finished (``fin``: its
    ``FinishedRequest``: reason ``stop`` with the stop token or None for a stop string,
    ``length`` with the output length): ``matched`` is the stop string its text matched, if any
    (it names the match even when a stop token ended the same iteration)."""
    if matched is not None:
        return {"type": "stop", "matched": matched}
    if fin.reason == "length":
        return {"type": "length", "length": int(fin.output_len)}
    if fin.reason == "stop":
        return {"type": "stop", "matched": fin.stop_token_id}
    return {"type": "abort", "message": "aborted"}


def aborted(message: str) -> dict[str, Any]:
    """The finish reason of a request its client aborted (``message``: how)."""
    return {"type": "abort", "message": message, "cause": "client"}


def shut_down(message: str) -> dict[str, Any]:
    """The finish reason of a request ended by a shutdown of the engine or server."""
    return {"type": "abort", "message": message, "cause": "shutdown"}


def failed(message: str, status_code: int = 500) -> dict[str, Any]:
    """The finish reason of a request the engine failed; ``message`` names the cause;
    ``status_code``: 500, 503 when the engine as a whole is down, 400 when the request's own
    content stopped it (:func:`error_body` then answers ``invalid_request_error``)."""
    return {"type": FAILED, "message": message, "status_code": int(status_code)}


def is_failure(reason: dict[str, Any] | None) -> bool:
    """True for the finish reason of a failed request (:func:`failed`)."""
    return reason is not None and reason.get("type") == FAILED


def end_kind(reason: dict[str, Any] | None) -> EndKind | None:
    """``"finished"``, ``"aborted"``, ``"shutdown"`` or ``"failed"`` for a last chunk's
    ``finish_reason`` (None: not ended). An ``abort`` without a ``cause`` counts as aborted."""
    if reason is None:
        return None
    kind = reason.get("type")
    if kind == FAILED:
        return "failed"
    if kind == "abort":
        return "shutdown" if reason.get("cause") == "shutdown" else "aborted"
    return "finished"


def error_body(reason: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``(HTTP status, OpenAI error body)`` for a failed request's finish reason: 503
    ``service_unavailable`` / ``engine_failed`` when the engine is down, else 500
    ``internal_error`` / ``engine_error``, a 4xx ``invalid_request_error``; the message is the
    cause."""
    status = int(reason.get("status_code", 500))
    down = status == 503
    if 400 <= status < 500:  # the request's own content (e.g. a grammar at a dead end)
        return status, {"error": {
            "message": f"The engine could not complete this request: {reason.get('message')}",
            "type": "invalid_request_error", "param": None, "code": "invalid_value"}}
    return status, {"error": {
        "message": f"The engine failed this request: {reason.get('message', 'unknown cause')}",
        "type": "service_unavailable" if down else "internal_error", "param": None,
        "code": "engine_failed" if down else "engine_error"}}

"""Large JSON response bodies without stalling the event loop.

A non-streaming answer with logprobs can be tens of MB (``n`` choices of an echoed prompt
with 20 top alternatives per token: 32 choices x 600 tokens made 20 MB). Starlette's
``JSONResponse`` encodes the body in one ``json.dumps`` call, a C call that holds the GIL
throughout (2.5 s for 20 MB on the loaded 2-core machine): on the event loop it stalls every
other request's stream and ``/health``, and in a thread it still does (the GIL). So
:func:`json_response` builds and encodes the body in a thread, one part at a time (the items
of lists and the values of objects down to :data:`DEPTH` levels, each encoded whole below
that), so that the GIL is given back between parts. The bytes are exactly
``JSONResponse``'s (``ensure_ascii=False``, ``allow_nan=False``, compact separators).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi.responses import Response

__all__ = ["DEPTH", "dumps_in_parts", "json_response"]

#: Levels split into parts: an OpenAI body's ``choices[i].logprobs.top_logprobs[j]`` (chat:
#: ``content[j]``) and SGLang's ``[i].meta_info.output_top_logprobs[j]`` are parts.
DEPTH = 5

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _parts(value: Any, depth: int, out: list[str]) -> None:
    if depth > 0 and isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _parts(item, depth - 1, out)
        out.append("]")
    elif depth > 0 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                out.append(",")
            out.append(_ENCODER.encode(key))
            out.append(":")
            _parts(item, depth - 1, out)
        out.append("}")
    else:
        out.append(_ENCODER.encode(value))


def dumps_in_parts(value: Any, depth: int = DEPTH) -> bytes:
    """UTF-8 JSON of ``value``, byte for byte what ``JSONResponse(value).body`` is, encoded
    one part at a time (module docstring). Raises ``ValueError`` for NaN or infinite floats
    and ``TypeError`` for values JSON cannot hold, as ``JSONResponse`` does."""
    out: list[str] = []
    _parts(value, depth, out)
    return "".join(out).encode("utf-8")


async def json_response(build: Callable[[], Any], status_code: int = 200) -> Response:
    """A JSON response of ``build()`` (a JSON-able value), built and encoded in a worker
    thread (asyncio's default executor, not the server's one parsing thread, so that parsing
    other requests does not queue behind it)."""
    body = await asyncio.to_thread(lambda: dumps_in_parts(build()))
    return Response(body, status_code=status_code, media_type="application/json")

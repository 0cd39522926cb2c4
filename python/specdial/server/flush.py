"""SGLang's ``/flush_cache``: empty the engine's prefix cache (``GET`` or ``POST``).

SGLang's rule (``sglang/srt/entrypoints/http_server.py``, ``Scheduler.flush_cache``): the cache
is flushed only while no request is running or waiting; the answer is plain text, 200 with
:data:`FLUSHED` when it was flushed, 400 otherwise. Its optional query parameter ``timeout``
(seconds, >= 0, default 0) waits up to that long for the engine to become idle before giving
up; specdial retries the flush every :data:`RETRY_S` seconds until then. A ``timeout`` that is
not a finite number >= 0 is a 400 naming it. The engine's part is
``Engine.flush_cache() -> bool`` (False while requests are live); an engine without one (an
older test double) answers 501.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from fastapi.responses import Response

__all__ = ["FLUSHED", "NOT_FLUSHED", "RETRY_S", "flush_cache_response", "parse_timeout"]

#: SGLang's 200 body, word for word.
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")
#: The 400 body: why, and what to do.
NOT_FLUSHED = ("Cache not flushed: requests are running or waiting (the cache is flushed only "
               "when the engine is idle, as in SGLang). Retry when they are done, or pass "
               "?timeout=SECONDS to wait for them.\n")
#: Seconds between flush attempts while waiting for ``timeout``.
RETRY_S = 0.05


def parse_timeout(text: str | None) -> float | None:
    """The ``timeout`` query parameter in seconds (0 when absent), or None when it is not a
    finite number >= 0."""
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


async def flush_cache_response(engine: Any, timeout_text: str | None) -> Response:
    """The plain-text answer of ``/flush_cache`` for ``engine`` (module docstring); the flush
    runs off the event loop (it waits for the engine's loop thread)."""
    timeout = parse_timeout(timeout_text)
    if timeout is None:
        return Response(f"timeout: expected a number of seconds >= 0, got {timeout_text!r}\n",
                        status_code=400, media_type="text/plain")
    flush = getattr(engine, "flush_cache", None)
    if flush is None:
        return Response("this engine has no prefix cache to flush\n", status_code=501,
                        media_type="text/plain")
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(flush):
        if time.monotonic() >= deadline:
            return Response(NOT_FLUSHED, status_code=400, media_type="text/plain")
        await asyncio.sleep(RETRY_S)
    return Response(FLUSHED, status_code=200, media_type="text/plain")

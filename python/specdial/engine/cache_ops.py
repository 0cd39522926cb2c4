"""The engine's prefix-cache operations, run on the engine loop's thread.

:func:`flush_cache` is :meth:`specdial.Engine.flush_cache` (SGLang's ``/flush_cache``): it posts
a :class:`~specdial.engine.messages.FlushCache` message and waits for the loop to answer
between two iterations, so it is safe while the engine serves.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from specdial.engine.messages import FlushCache

__all__ = ["flush_cache"]


def flush_cache(engine: Any) -> bool:
    """Drop every cached KV page no request holds; True when flushed, False (nothing changed)
    while any request is live (SGLang's rule), on any data-parallel replica (each replica
    flushes its own cache; True only when all did). Raises ``RuntimeError`` when the engine is
    shut down or its loop has failed."""
    if engine.data_parallel is not None:
        return all([flush_cache(r) for r in engine.replicas])
    reply: Future[bool] = Future()
    engine._post(FlushCache(reply))
    return reply.result()

"""The engine's prefix-cache operations, run on the engine loop's thread.

:func:`flush_cache` is :meth:`specdial.Engine.flush_cache` (SGLang's ``/flush_cache``): it posts
a :class:`~specdial.engine.messages.FlushCache` message and waits for the loop to answer
between two iterations, so it is safe while the engine serves.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from specdial.engine.messages import FlushCache, RequestSpec

__all__ = ["cache_limit", "flush_cache", "note_cached_tokens"]


def flush_cache(engine: Any) -> bool:
    """Drop every cached KV page no request holds; True when flushed, False (nothing changed)
    while any request is live (SGLang's rule), on any data-parallel replica (each replica
    flushes its own cache; True only when all did). Raises ``RuntimeError`` when the engine is
    shut down or its loop has failed."""
    if engine.data_parallel is not None:
        return all([r.flush_cache() for r in engine.replicas])  # Engines or replica processes
    reply: Future[bool] = Future()
    engine._post(FlushCache(reply))
    return reply.result()


def cache_limit(spec: RequestSpec) -> int | None:
    """The prefix-cache positions request ``spec`` may take at an admission (the scheduler's
    ``max_cached_tokens``): prompt log-probabilities from ``prompt_start`` need positions
    ``max(prompt_start, 1) - 1 ..`` computed (SGLang caps its match at ``logprob_start_len``
    the same way); None: no limit."""
    lp = spec.logprobs
    if lp is None or lp.prompt_start is None:
        return None
    return max(lp.prompt_start, 1) - 1


def note_cached_tokens(plan: Any, rids: list[int], live: dict[int, Any]) -> None:
    """Record each request admitted by prefill ``plan`` (its chunk starts at its cached
    length) its prompt tokens served from the cache (``LiveRequest.cached_tokens``, SGLang's
    ``meta_info.cached_tokens``)."""
    starts = (np.asarray(plan.kv_lens) - np.asarray(plan.qo_lens)).tolist()
    for rid, start, cached in zip(rids, starts, plan.cached_lens.tolist()):
        lv = live.get(rid)
        if lv is not None and start == cached:
            lv.cached_tokens = min(int(cached), len(lv.spec.prompt_ids))

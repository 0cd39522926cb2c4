"""What a :class:`specdial.Engine` reports about itself: :meth:`~specdial.Engine.stats`,
:meth:`~specdial.Engine.graph_stats`, :attr:`~specdial.Engine.failure`,
:attr:`~specdial.Engine.degraded` and :attr:`~specdial.Engine.loop_turns`, for one replica or,
with ``dp_size > 1``, over the data-parallel front end
(:class:`~specdial.launch.data_parallel.DataParallelEngine`). The Engine binds these functions
as its methods and properties (as :func:`~specdial.engine.cache_ops.flush_cache`); they take
the Engine as their first argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdial.engine.api import EngineStats

__all__ = ["degraded", "failure", "graph_stats", "loop_turns", "stats"]


def loop_turns(engine: Any) -> int:
    """Engine loop turns so far (progress; a turn is at most one iteration). With
    ``dp_size > 1`` the replicas' turns summed
    (:attr:`~specdial.launch.data_parallel.DataParallelEngine.loop_turns`: a replica process's
    count as of its latest heartbeat, at most ``min(1 s, watchdog_timeout / 4)`` old); each
    replica's own is ``engine.replicas[i].loop_turns``."""
    if engine._dp is not None:
        return engine._dp.loop_turns
    return engine._loop.turns


def failure(engine: Any) -> str | None:
    """None while the engine can run its passes; else why not (its loop stopped, a
    tensor-parallel rank died or hung, or a data-parallel replica failed: the message
    names it). ``/health`` then answers 503 and ``/metrics`` reads ``specdial:engine_up``
    0."""
    if engine._dp is not None:
        return engine._dp.failure
    dead = engine._loop.dead
    if dead is not None:
        return f"the engine loop stopped: {type(dead).__name__}: {dead}"
    return None if engine._tp is None else engine._tp.failure


def degraded(engine: Any) -> str | None:
    """dp_size > 1: the failed replicas while others serve, else None."""
    return None if engine._dp is None else engine._dp.degraded


def graph_stats(engine: Any) -> dict[str, Any]:
    """CUDA-graph counters: ``replays`` per pass, ``eager`` fallbacks per reason,
    ``captured`` graphs (all zero without graphs). Read while no request runs. With
    ``dp_size > 1`` the replicas' summed
    (:meth:`~specdial.launch.data_parallel.DataParallelEngine.graph_stats`; each replica's own:
    ``engine.replicas[i].graph_stats()``)."""
    if engine._dp is not None:
        return engine._dp.graph_stats()
    worker = engine.worker
    if worker is None:
        return {"replays": {}, "eager": {}, "captured": 0}
    return worker.graph_stats()


def stats(engine: Any) -> EngineStats:
    """A snapshot of the gauges and counters (thread-safe; see :class:`EngineStats`); with
    ``dp_size > 1`` the replicas' aggregated
    (:func:`~specdial.launch.data_parallel.aggregate_stats`)."""
    if engine._dp is not None:
        return dataclasses.replace(engine._dp.stats(),
                                   policy_cache=engine.replicas[0].policy_cache.status)
    return dataclasses.replace(engine._loop.stats(), policy_cache=engine.policy_cache.status)

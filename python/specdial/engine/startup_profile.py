"""The adaptive config's start-up profiling run (SGLang's ``profile_run_*`` keys, PR #28045):
time every (steps, batch size) the policy can reach and feed the measurements to it (the
``throughput_aware`` cost table, or the ``goodput`` cost model's seed).

Which steps a batch size can reach is the core's routing (batch size -> graph padding -> slot ->
candidates), asked through :meth:`specdial._core.Scheduler.reachable_steps`, never re-derived
here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from specdial._core import AdaptiveConfig
from specdial.profiling import ProfilePoint, default_seq_len, profile_decode
from specdial.worker.graph_tables import default_cuda_graph_bs

if TYPE_CHECKING:
    from specdial.engine.parts import EngineParts

__all__ = ["profile_costs", "startup_profile"]

logger = logging.getLogger("specdial.engine")


def profile_costs(parts: "EngineParts", batch_sizes: list[int], steps: list[int], *,
                  n_warmup: int = 5, n_measure: int = 10, seq_len: int = 128,
                  reachable: Callable[[int, int], bool] | None = None) -> list[ProfilePoint]:
    """Seconds per decode iteration on ``parts``' real path per (steps, batch size)
    (:func:`specdial.profiling.profile_decode`; ``seq_len`` prompt tokens per request;
    ``reachable(steps, batch_size)``: which points to time, None: all)."""
    return profile_decode(parts.scheduler, parts.worker, batch_sizes=batch_sizes,
                          steps_values=steps, n_warmup=n_warmup, n_measure=n_measure,
                          seq_len=seq_len, vocab_size=parts.target.config.vocab_size,
                          generator=parts.generator, reachable=reachable)


def startup_profile(parts: "EngineParts", config: AdaptiveConfig) -> list[ProfilePoint]:
    """Run ``config.profile`` on ``parts`` before the first request and feed each point to the
    scheduler's policy (``set_profiled_cost``). Batch sizes: ``profile_run_batch_sizes``, else
    the CUDA-graph sizes, else (no graphs, where SGLang would profile nothing) the default
    capture sizes of ``max_running_requests``; at most ``max_profile_run_batch_size``. Steps:
    the config's candidates (``throughput_aware``: those > 0), each timed at the batch sizes
    whose slot offers it."""
    p = config.profile
    assert p is not None
    sizes = p["profile_run_batch_sizes"] or parts.cuda_graph_bs or default_cuda_graph_bs(
        parts.max_running_requests)
    if p["max_profile_run_batch_size"] is not None:
        sizes = [b for b in sizes if b <= p["max_profile_run_batch_size"]]
    steps = [k for k in config.candidate_steps
             if k > 0 or config.strategy != "throughput_aware"]
    sched = parts.scheduler

    def reachable(k: int, bs: int) -> bool:
        return k in sched.reachable_steps(bs)

    n = p["profile_run_n_warmup"] + p["profile_run_n_measure"]
    seq = p["profile_run_seq_len"] or default_seq_len(parts.context_length, n, max(steps))
    started = time.perf_counter()
    points = profile_costs(parts, sizes, steps, n_warmup=p["profile_run_n_warmup"],
                           n_measure=p["profile_run_n_measure"], seq_len=seq,
                           reachable=reachable)
    for pt in points:
        sched.set_profiled_cost(pt.batch_size, pt.steps, pt.seconds,
                                int(pt.context_per_request * pt.batch_size))
    logger.info("startup profiling (%s): %d points in %.1f s", config.strategy, len(points),
                time.perf_counter() - started)
    return points

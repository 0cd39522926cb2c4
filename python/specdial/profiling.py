"""Timing decode iterations on the real path: SGLang's startup profiling run for the
``throughput_aware`` strategy (PR #28045: ``profile_run_*`` keys), the optional seeding sweep of
``goodput``, and the cost-table file that ``specdial policy simulate`` / ``policy replay`` read.

For each ``(steps, batch size)`` point it admits ``batch size`` synthetic requests of
``seq_len`` prompt tokens through the engine's own scheduler and worker, runs ``n_warmup`` untimed
and ``n_measure`` timed decode iterations at fixed ``steps`` (timed as the engine loop times them:
``schedule()`` to the end of the passes, one host sync), then aborts them: every KV page comes
back. Runs on the calling thread and needs the engine idle (no loop thread yet). The synthetic
requests appear in the scheduler's counters (tokens generated, requests aborted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from specdial.worker.sampling import BatchSampling, SamplingParams

logger = logging.getLogger("specdial.profiling")


@dataclass(frozen=True)
class ProfilePoint:
    """One measured point: mean seconds of a decode iteration of ``batch_size`` requests at
    ``steps`` with ``context_per_request`` KV tokens each (the cost-table entry)."""

    batch_size: int
    steps: int
    context_per_request: float
    seconds: float

    def as_entry(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "steps": self.steps,
                "context_per_request": self.context_per_request, "seconds": self.seconds}


def default_seq_len(context_length: int, n_iterations: int, max_steps: int) -> int:
    """SGLang's default prompt length of a profiling request: ``min(2048, max(256, context -
    headroom))`` with room for the timed iterations, never beyond the context."""
    headroom = n_iterations * (max_steps + 1) + 16
    return max(1, min(min(2048, max(256, context_length - headroom)), context_length - headroom))


def _run(sched: Any, worker: Any, generator: torch.Generator | None, n: int,
         sampling: BatchSampling) -> tuple[list[float], int]:
    """Runs ``n`` decode iterations (prefills in between are run, untimed). Returns the seconds
    of each decode iteration and the batch's context tokens before the last one."""
    times: list[float] = []
    context = 0
    while len(times) < n:
        started = time.perf_counter()
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("profiling: nothing to schedule")
        if len(plan.preempted):
            raise RuntimeError("profiling: the KV cache is too small for this point")
        if plan.is_prefill:
            first = int(np.asarray(plan.sample_first).sum())
            greedy = BatchSampling.from_params([SamplingParams()] * first, worker.device)
            out = worker.prefill(plan, greedy if first else None, generator)
            sched.report(out.tokens, out.offsets)
            continue
        context = int(np.asarray(plan.positions).sum())
        out = worker.decode(plan, sampling, generator)
        seconds = time.perf_counter() - started
        sched.report(out.tokens, out.offsets, out.accepted)
        times.append(seconds)
    return times, context


def profile_decode(sched: Any, worker: Any, *, batch_sizes: Sequence[int],
                   steps_values: Sequence[int], n_warmup: int, n_measure: int, seq_len: int,
                   vocab_size: int, generator: torch.Generator | None = None,
                   reachable: Any = None) -> list[ProfilePoint]:
    """Measures every ``(steps, batch size)`` point (module docstring) and returns them.

    ``reachable(steps, batch_size)``: whether the policy can ever run that point (SGLang
    profiles only the graph sizes whose slot offers the steps); None: every point. A batch
    size above ``max_running_requests`` or whose prompts do not fit the KV cache is skipped with
    a warning. The scheduler's fixed steps are restored afterwards. Raises ``RuntimeError`` if a
    point cannot run (the engine must be idle).
    """
    if sched.has_unfinished():
        raise RuntimeError("profiling needs an idle engine (requests are live)")
    saved = sched.fixed_steps
    cfg = sched.config
    rng = np.random.default_rng(0)
    points: list[ProfilePoint] = []
    try:
        for steps in steps_values:
            for bs in batch_sizes:
                if reachable is not None and not reachable(steps, bs):
                    continue
                if bs > cfg.max_running_requests or bs * (seq_len + (n_warmup + n_measure) * (
                        steps + 1) + 16) > sched.num_slots:
                    logger.warning("profiling: skipping batch size %d at steps %d (%d requests "
                                   "of %d tokens do not fit max_running_requests=%d or the KV "
                                   "cache)", bs, steps, bs, seq_len, cfg.max_running_requests)
                    continue
                sched.set_fixed_steps(int(steps))
                n_iter = n_warmup + n_measure
                ids = [sched.add_request(rng.integers(1, vocab_size, seq_len).astype(np.int64),
                                         n_iter * (steps + 1) + 2, [], True) for _ in range(bs)]
                sampling = BatchSampling.from_params([SamplingParams()] * bs, worker.device)
                try:
                    times, context = _run(sched, worker, generator, n_iter, sampling)
                finally:
                    if sched.plan_in_flight:  # _run raised mid-plan
                        sched.abandon_plan()
                    for rid in ids:
                        sched.abort(rid)
                measured = times[n_warmup:]
                point = ProfilePoint(bs, int(steps), context / bs, float(np.mean(measured)))
                logger.info("profiling: steps=%d bs=%d context=%.0f/request: %.3f ms", steps, bs,
                            point.context_per_request, 1e3 * point.seconds)
                points.append(point)
    finally:
        sched.set_fixed_steps(saved)
        sched.flush_cache()  # the random prompts' pages would only wait for eviction
    return points


def cost_table(points: Sequence[ProfilePoint], *, device: str, model: str,
               graph_bs: Sequence[int] | None) -> dict[str, Any]:
    """The cost-table JSON object (:class:`specdial._core.CostTable`'s format)."""
    return {"device": device, "model": model,
            "graph_bs": None if graph_bs is None else list(graph_bs),
            "entries": [p.as_entry() for p in points]}

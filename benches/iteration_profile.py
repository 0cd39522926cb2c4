"""Where an engine iteration's time goes: model forwards vs. everything else.

    .venv/bin/python benches/iteration_profile.py [--concurrency 1,64] [--configs no-spec,fixed-3,adaptive]

Runs the built-in models (float32, CPU) on ``python/specdial/bench/prompts/code.jsonl`` at each concurrency
(``max_running_requests`` = concurrency, ``2 x concurrency`` requests submitted at once) and
splits the wall time of the engine loop's decode and prefill iterations into:

- ``forwards``: inside the target's and the drafter's ``forward`` and ``compute_logits`` (the
  model math; on the CPU torch runs synchronously, so wall time inside a call is its cost);
  ``drafter``: the drafter's part of it (draft steps, and the draft extend that keeps its KV
  cache warm, also at steps 0). Shares measured inside the same iterations are far less
  sensitive to a noisy machine than throughputs of separate runs;
- ``scheduler``: inside ``Scheduler.schedule()`` and ``Scheduler.report()`` (the Rust side:
  batching, KV slots, the adaptive decision, and the crossing itself);
- ``scheduler calls / iteration``: every crossing into the scheduler (a method call or a
  property read, ``schedule`` and ``report`` included) per loop iteration;
- ``other``: the rest of the iteration (Python worker: batch tensors, attention metadata,
  sampling / acceptance math, runtime-state switches; the loop: detokenizing, stop strings,
  emitting chunks, statistics).

Times come from ``time.perf_counter`` wrappers installed on the live engine (instance
attributes; nothing in the package is changed). Nested calls are counted once. The wrappers
themselves cost about 1 us per call, included in ``forwards`` / ``scheduler``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specdial.builtin import builtin_model_path
from specdial.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/
from tools.builtin_models.gates import pick  # noqa: E402
from tools.builtin_models.prompts import REPO_PROMPTS, read_jsonl  # noqa: E402

CONFIGS = {
    "no-spec": {"speculative_algorithm": None},
    "fixed-3": {"speculative_adaptive": False, "speculative_num_steps": 3},
    "fixed-0": {"speculative_adaptive": False, "speculative_num_steps": 0},
    "fixed-0+skip": {"speculative_adaptive": False, "speculative_num_steps": 0,
                     "skip_zero_step_draft_extend": True},
    "adaptive": {"speculative_adaptive": True},
    # the CPU-tuned candidates of examples/cpu_adaptive_config.json (see BENCHMARKS.md)
    "adaptive-cpu": {"speculative_adaptive": True, "speculative_adaptive_config": str(
        Path(__file__).resolve().parents[1] / "examples" / "cpu_adaptive_config.json")},
    # issue 28's arms (benches/verify_budgets_ab.py --issue28-arms): goodput over 0..7, batch-level,
    # per-request, and per-request with the confidence stop at a fixed min_survival
    **{name: {"speculative_adaptive_config": {"strategy": "goodput", "1": {
        "candidate_steps": list(range(8))}, **extra}} for name, extra in (
        ("goodput-batch", {}), ("goodput-per-request", {"verify": "per_request"}),
        ("goodput-per-request+ms0.3", {"verify": "per_request", "min_survival": 0.3}))},
}


class Clock:
    """Accumulates wall seconds per category; only the outermost timed call counts."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] = self.seconds.get(category, 0.0) + (
                    time.perf_counter() - t0)
                self.calls[category] = self.calls.get(category, 0) + 1
                self._depth -= 1
        return timed


class _TimedScheduler:
    """Delegates to the Rust scheduler, timing ``schedule`` and ``report`` and counting every
    crossing into it (a method call or a property read) in ``crossings``."""

    def __init__(self, sched: Any, clock: Clock) -> None:
        self._sched = sched
        self.crossings = 0
        schedule = clock.wrap("scheduler", sched.schedule)
        report = clock.wrap("scheduler", sched.report)

        def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.crossings += 1
                return fn(*args, **kwargs)
            return call
        self.schedule, self.report = counted(schedule), counted(report)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._sched, name)
        if not callable(value):
            self.crossings += 1  # a property read
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.crossings += 1
            return value(*args, **kwargs)
        return call


def instrument(engine: Engine) -> tuple[Clock, dict[str, Any]]:
    """Install the timers on ``engine``; returns the clock and the iteration totals."""
    clock = Clock()
    totals: dict[str, Any] = {"iterations": 0, "seconds": 0.0}
    worker, loop = engine.worker, engine._loop
    modules = [("target", worker.target)] + (
        [("drafter", worker.drafter.module)] if worker.drafter is not None else [])
    for category, m in modules:
        m.forward = clock.wrap(category, m.forward)
        m.compute_logits = clock.wrap(category, m.compute_logits)
    loop.sched = timed_sched = _TimedScheduler(loop.sched, clock)
    totals["sched"] = timed_sched  # type: ignore[assignment]
    iteration = loop.step

    def timed_iteration() -> None:
        t0 = time.perf_counter()
        iteration()
        totals["seconds"] += time.perf_counter() - t0
        totals["iterations"] += 1
    loop.step = timed_iteration  # type: ignore[method-assign]
    return clock, totals


def run(config: str, concurrency: int, prompts: list[str], max_new_tokens: int,
        drafter: str | None = None) -> dict[str, Any]:
    draft = {} if drafter is None else {"draft_model_path": str(builtin_model_path(drafter))}
    with Engine(model_path=None, max_running_requests=concurrency, context_length=512,
                log_interval_s=None, **draft, **CONFIGS[config]) as engine:
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate(prompts[:2], sampling_params=sp)  # warm-up, not timed
        clock, totals = instrument(engine)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        st = engine.stats()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    it_s = totals["seconds"]
    dr = clock.seconds.get("drafter", 0.0)
    fw, sc = clock.seconds.get("target", 0.0) + dr, clock.seconds.get("scheduler", 0.0)
    return {"config": config, "concurrency": concurrency, "requests": len(prompts),
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "iterations": totals["iterations"],
            "ms_per_iteration": round(1e3 * it_s / max(totals["iterations"], 1), 3),
            "loop_share_of_wall": round(it_s / wall, 3),
            "forwards_share": round(fw / it_s, 3), "drafter_share": round(dr / it_s, 3),
            "scheduler_share": round(sc / it_s, 4),
            "other_share": round(1 - (fw + sc) / it_s, 3),
            "scheduler_us_per_call": round(1e6 * sc / max(clock.calls.get("scheduler", 1), 1), 1),
            "scheduler_crossings_per_iteration": round(
                totals["sched"].crossings / max(totals["iterations"], 1), 2),
            "verify_lengths": dict(st.verify_length_histogram),
            "tree_nodes": dict(st.tree_node_histogram)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--configs", default="no-spec,fixed-3,adaptive")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-json", type=Path)
    ap.add_argument("--drafter", default=None,
                    help="a built-in drafter (e.g. eagle-weak; default: the engine's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = read_jsonl(REPO_PROMPTS / "code.jsonl")
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [r["prompt"] for r in pick(rows, 2 * c + 2)]
        for config in args.configs.split(","):
            res = run(config, c, prompts, args.max_new_tokens, args.drafter)
            print(json.dumps(res), flush=True)
            results.append(res)
    print()
    print("| config | c | tokens/s | ms / iteration | forwards | of which drafter | scheduler "
          "(Rust) | other (Python) | scheduler us / call | scheduler calls / iteration |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']} | "
              f"{r['ms_per_iteration']} | {r['forwards_share']:.1%} | {r['drafter_share']:.1%} | "
              f"{r['scheduler_share']:.2%} | {r['other_share']:.1%} | "
              f"{r['scheduler_us_per_call']} | {r['scheduler_crossings_per_iteration']} |")
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Prefix cache on vs off (issue 30): median TTFT and output tokens/s on the multi-turn chat and
shared-system-prompt workloads of ``specdial bench``, alternating the two engines.

    .venv/bin/python benches/prefix_cache_ab.py [--repetitions 5] [--workloads multiturn,shared-prefix]
        [--conversations 4] [--max-new-tokens 32] [--groups 4] [--per-group 4]
        [--system-prompt-len 512] [--question-len 32] [--concurrency 4] [--steps K]
        [--threads 1] [--json]

Two engines of the built-in models (EAGLE head, adaptive steps or ``--steps K`` fixed,
``policy_cache=False`` so that neither starts from what the other learned) differ only in
``enable_prefix_caching``. With adaptive steps the acceptance lengths of the sides are not
comparable (the policy picks the steps from costs that the cache changes); at fixed steps and
greedy they are (the drafter's state after a hit). Per
workload both run once as a warm-up; then each repetition runs the same requests on one engine
and then the other, the order swapped every repetition (so that slow drifts of a shared machine
fall on both), the cache flushed before every run (``Engine.flush_cache``: each run starts
cold and builds its own hits). Greedy, ``ignore_eos``. Workloads (:mod:`specdial.bench`):

- ``multiturn``: ``--conversations`` conversations of 4-8 turns over the ``code`` prompts, each
  turn resending the history with the engine's own answers, sent once the previous answer
  arrived; ``--concurrency`` conversations in flight;
- ``shared-prefix``: SGLang's generated-shared-prefix: ``--groups`` x ``--per-group`` requests,
  a group sharing a ``--system-prompt-len``-token system prompt, each its own question,
  ``--concurrency`` requests in flight.

Printed per workload and side: the median over repetitions of the TTFT mean and p50, output
tokens/s and the mean acceptance length, the cached prompt tokens of a run, and the ratios
off / on (TTFT) and on / off (tokens/s); ``--json`` prints every run's figures too. Speed is a
figure here, never an assertion (tests/test_benches.py only runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import torch

from specdial.bench.datasets import build_requests
from specdial.bench.driver import EngineDriver, run_benchmark
from specdial.bench.metrics import summarize
from specdial.bench.multiturn import conversation_runner, multiturn_conversations
from specdial.bench.prefix_workloads import shared_prefix_requests
from specdial.engine import Engine

SIDES = ("on", "off")
FIGURES = ("ttft_mean_ms", "ttft_p50_ms", "output_tokens_per_s", "accept_length")


def workload(name: str, driver: EngineDriver, engine: Any, args: argparse.Namespace
             ) -> tuple[list[Any], Any]:
    """The requests of workload ``name`` and their runner (None: independent requests)."""
    if name == "multiturn":
        messages = build_requests("code", args.conversations * 8, seed=0)
        convs = multiturn_conversations(messages, args.conversations,
                                        max_new_tokens=args.max_new_tokens, seed=0,
                                        encode=driver.encode, fits=driver.fits)
        return [t for c in convs for t in c.turns], conversation_runner(convs)
    if name == "shared-prefix":
        return shared_prefix_requests(
            num_groups=args.groups, prompts_per_group=args.per_group,
            system_prompt_len=args.system_prompt_len, question_len=args.question_len,
            output_len=args.max_new_tokens, vocab_size=engine.target.config.vocab_size,
            seed=0), None
    raise ValueError(f"--workloads: unknown workload {name!r}; known: multiturn, shared-prefix")


def one_run(engine: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Flush ``engine``'s cache, run workload ``name`` once, and return its figures."""
    while not engine.flush_cache():  # False while the previous run's requests finish
        time.sleep(0.01)
    driver = EngineDriver(engine)
    requests, runner = workload(name, driver, engine, args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    run = asyncio.run(run_benchmark(driver, requests, sampling_params=params,
                                    concurrency=args.concurrency, progress=False,
                                    sample_interval=0.25, runner=runner))
    s = summarize([run])
    if s["failed"]:
        raise RuntimeError(f"{name}: {s['failed']} requests failed: {s['errors']}")
    return {"ttft_mean_ms": 1e3 * s["ttft_s"]["mean"], "ttft_p50_ms": 1e3 * s["ttft_s"]["p50"],
            "output_tokens_per_s": s["output_throughput"],
            "accept_length": s["mean_accept_length"], "cached_tokens": s["cached_tokens"],
            "input_tokens": s["input_tokens"], "requests": s["completed"],
            "ttft_per_turn_ms": {t: 1e3 * v["p50"] for t, v in s["ttft_per_turn_s"].items()}}


def measure(name: str, engines: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then ``--repetitions`` alternating rounds of workload ``name``."""
    for side in SIDES:
        one_run(engines[side], name, args)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for rep in range(args.repetitions):
        for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
            runs[side].append(one_run(engines[side], name, args))
    med = {side: {f: statistics.median(r[f] for r in runs[side] if r[f] is not None)
                  for f in FIGURES} for side in SIDES}
    return {"workload": name, "median": med, "runs": runs,
            "ttft_ratio_off_on": med["off"]["ttft_p50_ms"] / med["on"]["ttft_p50_ms"],
            "ttft_mean_ratio_off_on": med["off"]["ttft_mean_ms"] / med["on"]["ttft_mean_ms"],
            "throughput_ratio_on_off": med["on"]["output_tokens_per_s"]
            / med["off"]["output_tokens_per_s"]}


def format_row(row: dict[str, Any]) -> str:
    """The lines printed for one workload."""
    lines = [f"{row['workload']} (medians of {len(row['runs']['on'])} alternating runs)"]
    for side in SIDES:
        m, last = row["median"][side], row["runs"][side][-1]
        lines.append(f"  cache {side:>3}: TTFT mean {m['ttft_mean_ms']:8.1f} ms, p50 "
                     f"{m['ttft_p50_ms']:8.1f} ms, {m['output_tokens_per_s']:7.1f} output "
                     f"tok/s, accept length {m['accept_length'] or 0:.2f}, cached "
                     f"{last['cached_tokens']} of {last['input_tokens']} prompt tokens")
    lines.append(f"  TTFT p50 off/on {row['ttft_ratio_off_on']:.2f}x, mean off/on "
                 f"{row['ttft_mean_ratio_off_on']:.2f}x; output tok/s on/off "
                 f"{row['throughput_ratio_on_off']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--workloads", default="multiturn,shared-prefix")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--steps", type=int, default=None,
                   help="fixed speculative_num_steps (default: adaptive); with greedy requests "
                   "the acceptance length is then comparable between the sides (the drafter's "
                   "state after a hit)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kw: dict[str, Any] = dict(model_path=None, max_running_requests=args.concurrency,
                              log_interval_s=None, policy_cache=False)
    if args.steps is not None:
        kw.update(speculative_adaptive=False, speculative_num_steps=args.steps)
    engines = {"on": Engine(enable_prefix_caching=True, **kw),
               "off": Engine(enable_prefix_caching=False, **kw)}
    try:
        rows = [measure(w.strip(), engines, args) for w in args.workloads.split(",") if w.strip()]
    finally:
        for e in engines.values():
            e.shutdown()
    print(json.dumps(rows, indent=1) if args.json else "\n".join(map(format_row, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

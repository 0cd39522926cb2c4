"""Data parallelism on this machine: output tokens/s of one engine against two replicas behind
:class:`specdial.launch.data_parallel.DataParallelEngine` (issue 17), same workload, same
script, built-in models (7M target + EAGLE head, adaptive steps), greedy.

Configurations: dp 1 with 1 torch thread, dp 1 with 2 threads, dp 2 with 1 thread (the
replicas share the process: their loop threads release the GIL inside torch ops only). Each
runs ``--requests`` concurrent requests of ``--tokens`` tokens (``ignore_eos``) after a
warm-up, ``--repeats`` times; the median tokens/s is reported, and the ratios to dp 1.

Usage: ``nice -n 19 .venv/bin/python benches/dp_throughput.py [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import specdial
from specdial.launch.data_parallel import DataParallelEngine

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "for i in range(",
           "def add(a, b):\n    return", "# parse the arguments\n", "with open(path) as f:",
           "try:\n    import"]


def run(engine, requests: int, tokens: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / seconds


def measure(dp: int, threads: int, ns: argparse.Namespace) -> float:
    torch.set_num_threads(threads)
    replicas = [specdial.Engine(max_running_requests=ns.requests, log_interval_s=None)
                for _ in range(dp)]
    engine = replicas[0] if dp == 1 else DataParallelEngine(replicas)
    try:
        run(engine, ns.requests, 8)  # warm-up
        return statistics.median(run(engine, ns.requests, ns.tokens) for _ in range(ns.repeats))
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    rows = {}
    for name, dp, threads in (("dp1_1thread", 1, 1), ("dp1_2threads", 1, 2),
                              ("dp2_1thread", 2, 1)):
        rows[name] = measure(dp, threads, ns)
        print(f"{name:14s} {rows[name]:8.1f} tok/s", flush=True)
    ratios = {"dp2_over_dp1_1thread": rows["dp2_1thread"] / rows["dp1_1thread"],
              "dp2_over_dp1_2threads": rows["dp2_1thread"] / rows["dp1_2threads"]}
    print(" ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"tokens_per_s": rows, "ratios": ratios,
                                            "requests": ns.requests, "tokens": ns.tokens},
                                           indent=1))


if __name__ == "__main__":
    main()

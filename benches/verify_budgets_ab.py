"""Paired A/B of two engine configurations on the ``mixed-batch`` workload (issue 28: the
per-request verify budgets against the batch-level goodput strategy), in alternating rounds.

    .venv/bin/python benches/verify_budgets_ab.py --a '{"speculative_adaptive": true}' \\
        --b '{"speculative_adaptive": true, "KEY": "VALUE"}' [--concurrency 16,64] [--rounds 9]

``--a`` / ``--b``: JSON objects of :class:`~specdial.config.EngineConfig` options (the arm
``b`` is the candidate, ``a`` the baseline). The built-in target and ``--drafter`` (default the
weak EAGLE head, ``builtin/eagle-weak``) are loaded once; every run builds a fresh engine over
them (``Engine.from_modules``, no policy cache), warms it with a few requests (untimed), then
runs ``--num-prompts`` requests of ``mixed-batch`` (greedy code and temperature-1.0 prose
interleaved in arrival order; ``--max-new-tokens`` each, EOS ignored) at the concurrency, all
arriving at once. Each round runs both arms, the order swapped every round. Per concurrency
the report gives each arm's median output tokens/s, the median over rounds of the paired
ratio b / a, and the 90 % bootstrap interval of that median (2000 resamples of the rounds),
with every round's ratio; ``--json FILE`` writes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from typing import Any

import torch

from specdial.bench.datasets import build_requests
from specdial.bench.driver import EngineDriver, run_benchmark
from specdial.bench.metrics import summarize
from specdial.builtin import builtin_model_path
from specdial.engine import Engine


def bootstrap_median(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of ``xs`` resampled with replacement."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n) - 1]


def one_run(base: Engine, options: dict[str, Any], concurrency: int, args: Any) -> dict:
    engine = Engine.from_modules(base.target, base.drafter, base.tokenizer,
                                 max_running_requests=concurrency, log_interval_s=None,
                                 policy_cache=False, **options)
    try:
        driver = EngineDriver(engine)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        reqs = build_requests("mixed-batch", args.num_prompts + concurrency, seed=args.seed,
                              keep=lambda r: driver.prepare(r, args.max_new_tokens))
        warm, timed = reqs[:concurrency], reqs[concurrency:]
        asyncio.run(run_benchmark(driver, warm, sampling_params=params,
                                  concurrency=concurrency, progress=False))
        run = asyncio.run(run_benchmark(driver, timed, sampling_params=params,
                                        concurrency=concurrency, progress=False))
        s = summarize([run])
        return {"tokens_per_s": s["output_throughput"],
                "verify_lengths": s["verify_length_histogram"],
                "accept_length": s["mean_accept_length"]}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default='{"speculative_adaptive": true}')
    ap.add_argument("--b", required=True)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default="eagle-weak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arms = {"a": json.loads(args.a), "b": json.loads(args.b)}
    base = Engine(draft_model_path=str(builtin_model_path(args.drafter)), log_interval_s=None,
                  policy_cache=False)
    base.shutdown()
    report: dict[str, Any] = {"arms": arms, "drafter": args.drafter, "by_concurrency": {}}
    for c in (int(x) for x in args.concurrency.split(",")):
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
            got = {arm: one_run(base, arms[arm], c, args) for arm in order}
            got["ratio"] = got["b"]["tokens_per_s"] / got["a"]["tokens_per_s"]
            rounds.append(got)
            print(json.dumps({"concurrency": c, "round": r, **got}), flush=True)
        ratios = [g["ratio"] for g in rounds]
        lo, hi = bootstrap_median(ratios)
        report["by_concurrency"][c] = {
            "median_tokens_per_s": {arm: statistics.median(g[arm]["tokens_per_s"]
                                                           for g in rounds) for arm in "ab"},
            "median_ratio_b_over_a": statistics.median(ratios), "bootstrap90": [lo, hi],
            "ratios": [round(x, 3) for x in ratios]}
        print(json.dumps({"concurrency": c, **report["by_concurrency"][c]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

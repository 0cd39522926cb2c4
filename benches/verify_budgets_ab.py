"""Paired A/B(/C...) of engine configurations on the ``mixed-batch`` workload (issue 28: the
per-request verify budgets, with and without the confidence stop, against the batch-level
goodput strategy), in alternating rounds.

    .venv/bin/python benches/verify_budgets_ab.py --a '{"speculative_adaptive": true}' \\
        --b '{"speculative_adaptive": true, "KEY": "VALUE"}' [--concurrency 16,64] [--rounds 9]
    .venv/bin/python benches/verify_budgets_ab.py --issue28-arms 0.3,0.6 [--auto] ...

``--a`` / ``--b``: JSON objects of :class:`~specdial.config.EngineConfig` options (the arm
``b`` is the candidate, ``a`` the baseline). ``--issue28-arms MS,...`` replaces them by issue
28's arms: ``batch`` (the goodput strategy, batch-level; the baseline), ``per_request``, and
``per_request+msX`` for each fixed ``min_survival`` X (the confidence stop); ``--auto`` adds
``per_request+auto`` (``"min_survival": "auto"``, the policy choosing it: only where that part
of issue 28 is merged; elsewhere the engine refuses the key's value and the run stops). Every
arm after the first is reported as a ratio over the first; arm ``b`` of the two-arm form is the
``b`` / ``a`` ratio as before. The built-in target and ``--drafter`` (default the
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


def issue28_arms(survivals: str, auto: bool) -> dict[str, dict[str, Any]]:
    """``{name: options}``: ``batch`` first (the baseline), then ``per_request`` and one
    ``per_request+msX`` arm per fixed ``min_survival`` in ``survivals`` (comma-separated), and
    ``per_request+auto`` with ``auto``."""
    def goodput(**kw: Any) -> dict[str, Any]:  # section 17's candidates, 0..7
        return {"speculative_adaptive_config": {
            "strategy": "goodput", "1": {"candidate_steps": list(range(8))}, **kw}}
    arms = {"batch": goodput(), "per_request": goodput(verify="per_request")}
    for x in (float(v) for v in survivals.split(",") if v):
        arms[f"per_request+ms{x:g}"] = goodput(verify="per_request", min_survival=x)
    if auto:
        arms["per_request+auto"] = goodput(verify="per_request", min_survival="auto")
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default='{"speculative_adaptive": true}')
    ap.add_argument("--b", default=None, help="required without --issue28-arms")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default="eagle-weak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--issue28-arms", default=None, metavar="MS,...",
                    help="issue 28's arms with these fixed min_survival values (see above)")
    ap.add_argument("--auto", action="store_true",
                    help="with --issue28-arms: add the per_request+auto arm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.auto and args.issue28_arms is None:
        ap.error("--auto needs --issue28-arms")
    if args.b is None and args.issue28_arms is None:
        ap.error("--b (or --issue28-arms) is required")
    arms = ({"a": json.loads(args.a), "b": json.loads(args.b)} if args.issue28_arms is None
            else issue28_arms(args.issue28_arms, args.auto))
    names = list(arms)
    base = Engine(draft_model_path=str(builtin_model_path(args.drafter)), log_interval_s=None,
                  policy_cache=False)
    base.shutdown()
    report: dict[str, Any] = {"arms": arms, "drafter": args.drafter, "by_concurrency": {}}
    for c in (int(x) for x in args.concurrency.split(",")):
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            # every arm in every position: rotate the order, and reverse it every other round
            order = names[r % len(names):] + names[:r % len(names)]
            order = order if r % 2 == 0 else order[::-1]
            got = {arm: one_run(base, arms[arm], c, args) for arm in order}
            got["ratio"] = {arm: got[arm]["tokens_per_s"] / got[names[0]]["tokens_per_s"]
                            for arm in names[1:]}
            rounds.append(got)
            print(json.dumps({"concurrency": c, "round": r, **got}), flush=True)
        per_arm = {}
        for arm in names[1:]:
            ratios = [g["ratio"][arm] for g in rounds]
            lo, hi = bootstrap_median(ratios)
            per_arm[arm] = {"median_ratio": statistics.median(ratios), "bootstrap90": [lo, hi],
                            "ratios": [round(x, 3) for x in ratios]}
        report["by_concurrency"][c] = {
            "median_tokens_per_s": {arm: statistics.median(g[arm]["tokens_per_s"]
                                                           for g in rounds) for arm in names},
            "over": names[0], "by_arm": per_arm}
        if list(arms) == ["a", "b"]:  # the two-arm form's keys
            report["by_concurrency"][c].update(
                median_ratio_b_over_a=per_arm["b"]["median_ratio"],
                bootstrap90=per_arm["b"]["bootstrap90"], ratios=per_arm["b"]["ratios"])
        print(json.dumps({"concurrency": c, **report["by_concurrency"][c]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

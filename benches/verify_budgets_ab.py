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
arriving at once. Each round runs every arm, in an order that gives every arm every position
(:func:`round_order`).

Two clocks per run, over the timed requests only (the warm-up excluded):

- wall: output tokens per second (``output_throughput``), what a user sees, and what a loaded
  machine distorts most (another process's burst lands in one arm's run, not the other's);
- CPU: seconds of CPU per output token, of the whole process (``time.process_time``: the engine
  loop thread, which runs the passes in this process, plus the client driver and any helper
  thread) and of the engine loop thread alone (its POSIX thread CPU clock). On a loaded machine
  a run's CPU time grows far less than its wall time (waiting for a core is not counted), so
  the CPU ratio is the reading that still means something there; it misses what is not CPU
  work of this process (a GPU's time, memory stalls are counted as CPU), so on an idle machine
  the wall ratio is the figure to report. ``--threads`` > 1 spreads torch's work over OpenMP
  threads, which the process clock counts and the loop thread's does not.

Per concurrency the report gives each arm's median tokens/s and CPU ms per token (process and
loop thread), and per arm after the first its paired ratios over the first on both clocks
(wall: tokens/s b / a; CPU: CPU seconds per token a / b, so > 1 means b is cheaper on both),
their medians over rounds and the 90 % bootstrap interval of each median (2000 resamples of
the rounds), with every round's ratios; every round is also printed as one JSON line with its
seconds, the load average before it, and the rounds' progress, and ``--json FILE`` writes it
all. The wall time of the whole command is about ``rounds x arms x (concurrency + num_prompts)
x max_new_tokens / (tokens/s)`` plus an engine construction per run (see the report's
``round_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
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


def thread_cpu_clock(thread: Any) -> Any:
    """A function returning the CPU seconds ``thread`` (a started :class:`threading.Thread`)
    has used so far: its POSIX thread CPU clock (Linux; ``time.pthread_getcpuclockid``)."""
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime(clock)


def one_run(base: Engine, options: dict[str, Any], concurrency: int, args: Any) -> dict:
    """One arm's run: a fresh engine, the warm-up, then the timed requests on both clocks
    (module docs). Returns tokens/s, CPU seconds per output token (``cpu_s_per_token``: the
    process, ``loop_cpu_s_per_token``: the engine loop thread), the output tokens and wall
    seconds of the timed requests, their verify-length histogram and acceptance length."""
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
        loop_cpu = thread_cpu_clock(engine._loop.thread)  # started: the warm-up ran on it
        cpu0, loop0 = time.process_time(), loop_cpu()
        run = asyncio.run(run_benchmark(driver, timed, sampling_params=params,
                                        concurrency=concurrency, progress=False))
        cpu, loop = time.process_time() - cpu0, loop_cpu() - loop0
        s = summarize([run])
        tokens = s["output_tokens"]
        return {"tokens_per_s": s["output_throughput"], "cpu_s_per_token": cpu / tokens,
                "loop_cpu_s_per_token": loop / tokens, "output_tokens": tokens,
                "wall_s": s["duration_s"], "verify_lengths": s["verify_length_histogram"],
                "tree_nodes": s["tree_node_histogram"],
                "accept_length": s["mean_accept_length"]}
    finally:
        engine.shutdown()


def paired(rounds: list[dict[str, Any]], arm: str, clock: str) -> dict[str, Any]:
    """The paired ratios of ``arm`` over the baseline on ``clock`` (``"wall"`` or ``"cpu"``),
    their median over rounds and its 90 % bootstrap interval."""
    ratios = [g["ratio" if clock == "wall" else "ratio_cpu"][arm] for g in rounds]
    lo, hi = bootstrap_median(ratios)
    return {"median_ratio": statistics.median(ratios), "bootstrap90": [lo, hi],
            "ratios": [round(x, 3) for x in ratios]}


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


def round_order(names: list[str], r: int) -> list[str]:
    """The arms' order in round ``r``: ``names`` rotated by ``r // 2``, reversed in odd rounds.
    Two arms alternate ABBA (each first in half the rounds); three run all six orders in six
    rounds. (Rotating by ``r`` and reversing odd rounds, as before, put the first of two arms
    first in every round: the rotation and the reversal cancel.)"""
    k = (r // 2) % len(names)
    order = names[k:] + names[:k]
    return order if r % 2 == 0 else order[::-1]


def run_round(base: Engine, arms: dict[str, dict[str, Any]], names: list[str], c: int,
              r: int, args: Any) -> dict[str, Any]:
    """Round ``r`` at concurrency ``c``: every arm once, in :func:`round_order`; the paired
    ratios over the first arm on both clocks. Prints the round as one JSON line."""
    order = round_order(names, r)
    load, started = os.getloadavg()[0], time.perf_counter()
    got: dict[str, Any] = {arm: one_run(base, arms[arm], c, args) for arm in order}
    base_arm = got[names[0]]
    got["ratio"] = {arm: got[arm]["tokens_per_s"] / base_arm["tokens_per_s"]
                    for arm in names[1:]}
    got["ratio_cpu"] = {arm: base_arm["cpu_s_per_token"] / got[arm]["cpu_s_per_token"]
                        for arm in names[1:]}
    got["ratio_loop_cpu"] = {
        arm: base_arm["loop_cpu_s_per_token"] / got[arm]["loop_cpu_s_per_token"]
        for arm in names[1:]}
    got["round_seconds"], got["load_average_1m"] = time.perf_counter() - started, load
    print(json.dumps({"concurrency": c, "round": r, "order": order, **got}), flush=True)
    return got


def summary(rounds: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One concurrency's report (module docs) from its rounds."""
    def med(arm: str, key: str) -> float:
        return statistics.median(g[arm][key] for g in rounds)
    per_arm = {arm: {**paired(rounds, arm, "wall"), "cpu": paired(rounds, arm, "cpu")}
               for arm in names[1:]}
    out: dict[str, Any] = {
        "median_tokens_per_s": {arm: med(arm, "tokens_per_s") for arm in names},
        "median_cpu_ms_per_token": {arm: 1e3 * med(arm, "cpu_s_per_token") for arm in names},
        "median_loop_cpu_ms_per_token": {arm: 1e3 * med(arm, "loop_cpu_s_per_token")
                                         for arm in names},
        "over": names[0], "by_arm": per_arm,
        "round_seconds": [round(g["round_seconds"], 1) for g in rounds],
        "load_average_1m": [round(g["load_average_1m"], 2) for g in rounds]}
    if names == ["a", "b"]:  # the two-arm form's keys
        b = per_arm["b"]
        out.update(median_ratio_b_over_a=b["median_ratio"], bootstrap90=b["bootstrap90"],
                   ratios=b["ratios"], median_cpu_ratio_b_over_a=b["cpu"]["median_ratio"],
                   cpu_bootstrap90=b["cpu"]["bootstrap90"])
    return out


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
    concurrencies = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not concurrencies or min(concurrencies) < 1 or args.rounds < 1:
        ap.error(f"--concurrency must list integers >= 1 (got {args.concurrency!r}) and "
                 f"--rounds must be >= 1 (got {args.rounds})")
    base = Engine(draft_model_path=str(builtin_model_path(args.drafter)), log_interval_s=None,
                  policy_cache=False)
    base.shutdown()
    report: dict[str, Any] = {"arms": arms, "drafter": args.drafter, "by_concurrency": {},
                              "args": vars(args), "started_utc": time.strftime(
                                  "%Y-%m-%d %H:%M:%S", time.gmtime())}
    for c in concurrencies:
        rounds = [run_round(base, arms, names, c, r, args) for r in range(args.rounds)]
        report["by_concurrency"][c] = summary(rounds, names)
        print(json.dumps({"concurrency": c, **report["by_concurrency"][c]}), flush=True)
        if args.json:  # after every concurrency: a long run stopped midway keeps what it read
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""One load-ramp run of the default engine, iteration by iteration: batch size, the steps the
goodput strategy ran (probes marked), and its cost model's predicted seconds against the measured
seconds of every decode iteration. Writes ``ramp_trace.jsonl`` (the engine's per-verify trace),
``ramp_timeline.json`` (a summary) and ``ramp_timeline.png`` into ``--out``.

    .venv/bin/python benches/ramp_timeline.py --out benches/results/DIR --peak 64 --cpu-threads 1

The engine is warmed with one small ramp first (the run shows a server that has already served),
unless ``--cold``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
import torch

from specdial.bench.datasets import build_requests
from specdial.bench.driver import EngineDriver, ramp_concurrency, run_benchmark
from specdial.bench.metrics import summarize
from specdial.engine import Engine


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "ramp_trace.jsonl"
    trace.unlink(missing_ok=True)
    torch.set_num_threads(args.cpu_threads)
    n = 4 * args.peak
    engine = Engine(model_path=None, max_running_requests=args.peak, log_interval_s=None,
                    record_trace=str(trace))
    driver = EngineDriver(engine)
    reqs = build_requests("code", n, seed=0,
                          keep=lambda r: driver.prepare(r, args.max_new_tokens))
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    if not args.cold:
        asyncio.run(run_benchmark(driver, reqs[: max(8, n // 4)], sampling_params=params,
                                  progress=False, concurrency_schedule=ramp_concurrency(
                                      max(8, n // 4), args.peak // 4 or 1)))
        trace.write_text("")  # the warm-up's iterations are not part of the figure
    data = asyncio.run(run_benchmark(driver, reqs, sampling_params=params, progress=False,
                                     concurrency_schedule=ramp_concurrency(n, args.peak)))
    engine.shutdown()
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    s = summarize([data])
    measured = np.array([r["seconds"] for r in rows if "predicted_seconds" in r])
    predicted = np.array([r["predicted_seconds"] for r in rows if "predicted_seconds" in r])
    err = np.abs(predicted / measured - 1.0)
    steps = [r["steps"] for r in rows]
    summary = {
        "peak": args.peak, "requests": n, "max_new_tokens": args.max_new_tokens,
        "output_tokens_per_s": s["output_throughput"], "decode_iterations": len(rows),
        "steps_changes": int(sum(a != b for a, b in zip(steps, steps[1:]))),
        "steps_histogram": {str(k): steps.count(k) for k in sorted(set(steps))},
        "prediction_error_median": float(np.median(err)) if len(err) else None,
        "prediction_error_p90": float(np.quantile(err, 0.9)) if len(err) else None,
    }
    (out / "ramp_timeline.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(rows, out / "ramp_timeline.png", args.peak)
    return summary


def plot(rows: list[dict], path: Path, peak: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    a.plot(x, [r["batch_size"] for r in rows], color="grey", lw=1, label="batch size")
    a.set_ylabel("batch size (requests)")
    a2 = a.twinx()
    a2.step(x, [r["steps"] for r in rows], where="post", color="tab:blue", lw=1.2,
            label="steps run")
    a2.set_ylabel("speculative_num_steps")
    a.set_title(f"goodput strategy over a load ramp (1 -> {peak} -> 1 concurrent), built-in models, CPU")
    a.legend(loc="upper left", fontsize=8)
    a2.legend(loc="upper right", fontsize=8)
    meas = [1e3 * r.get("seconds", np.nan) for r in rows]
    pred = [1e3 * r.get("predicted_seconds", np.nan) for r in rows]
    b.plot(x, meas, ".", ms=2.5, color="tab:orange", label="measured")
    b.plot(x, pred, "-", lw=1, color="tab:green", label="predicted before running")
    b.set_ylabel("decode iteration (ms)")
    b.set_xlabel("decode iteration")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--peak", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="no warm-up ramp")
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()

"""Cache-seeded adaptive vs every fixed depth at batch size 1, in short alternating rounds
(issue 26, BENCHMARKS.md section "The policy cache").

1. Training: an ``Engine`` with the built-in models and a scratch policy cache runs
   ``--train`` generations of ``--max-new-tokens`` tokens (code prompts) and shuts down, which
   writes the cache file (the real path of ``specdial generate``).
2. Rounds (``--rounds``, >= 9 for the figure): each round takes the next code prompt and runs
   one greedy generation of ``--max-new-tokens`` tokens per configuration, in an order rotated
   every round: ``adaptive-cached`` (a fresh engine whose goodput policy is seeded from the
   cache file, as ``Engine`` does at start), ``adaptive-fresh`` (a fresh engine with no cache),
   ``fixed-1`` .. ``fixed-7`` and ``no-spec``. Every engine is built over the same loaded modules
   (``Engine.from_modules``) for each generation, so each starts cold, like a CLI run, and pays
   the same one-time costs; a 4-token generation before the timed one warms them up alike.
3. Report: per configuration the median tokens/s over rounds; the best fixed depth (highest
   median); per round adaptive-cached / best fixed in the same round, and the median of that
   ratio (the figure the issue asks >= 0.97 of).

Run: ``.venv/bin/python benches/policy_cache_rounds.py [--rounds 9] [--json]``. One torch
thread (``--threads``), as the README advises on a small shared CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdial.bench.datasets import load_jsonl
from specdial.engine import Engine

PROMPTS = Path(__file__).resolve().parent.parent / "python" / "specdial" / "bench" / "prompts"


def _timed(engine: Engine, prompt: str, n: int) -> float:
    engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0})  # warm-up, untimed
    t = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": n, "temperature": 0})
    seconds = time.perf_counter() - t
    return out["meta_info"]["completion_tokens"] / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--train", type=int, default=3, help="generations that fill the cache")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [r.prompt for r in load_jsonl(PROMPTS / "code.jsonl") if r.prompt]
    cache = tempfile.mkdtemp(prefix="specdial-policy-cache-")
    kw = dict(max_running_requests=1, log_interval_s=None)
    trainer = Engine(policy_cache_dir=cache, **kw)
    for i in range(args.train):
        trainer.generate(prompts[-1 - i], {"max_new_tokens": args.max_new_tokens, "temperature": 0})
    trainer.shutdown()
    (path,) = Path(cache).iterdir()
    state = json.dumps(json.loads(path.read_text())["state"])
    target, drafter, tok = trainer.target, trainer.drafter, trainer.tokenizer

    def build(name: str) -> Engine:
        if name == "no-spec":
            return Engine.from_modules(target, None, tok, **kw)
        if name.startswith("fixed-"):
            return Engine.from_modules(target, drafter, tok, speculative_adaptive=False,
                                       speculative_num_steps=int(name[6:]), **kw)
        engine = Engine.from_modules(target, drafter, tok, **kw)
        if name == "adaptive-cached":
            assert engine.scheduler.import_policy_state(state)
        return engine

    names = ["adaptive-cached", "adaptive-fresh", *(f"fixed-{k}" for k in range(1, 8)), "no-spec"]
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        prompt = prompts[r % (len(prompts) - args.train)]
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            engine = build(name)
            try:
                rates[name].append(_timed(engine, prompt, args.max_new_tokens))
            finally:
                engine.shutdown()
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names),
              flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    fixed = [n for n in names if n.startswith("fixed-")]
    best = max(fixed, key=lambda n: med[n])
    per_round = [a / b for a, b in zip(rates["adaptive-cached"], rates[best])]
    per_round_fresh = [a / b for a, b in zip(rates["adaptive-fresh"], rates[best])]
    result = {"rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "train": args.train, "load_avg": os.getloadavg(),
              "median_tokens_per_s": med, "best_fixed": best,
              "cached_vs_best_fixed_median": statistics.median(per_round),
              "cached_vs_best_fixed_per_round": per_round,
              "fresh_vs_best_fixed_median": statistics.median(per_round_fresh),
              "cached_vs_no_spec_median": statistics.median(
                  a / b for a, b in zip(rates["adaptive-cached"], rates["no-spec"]))}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("median tokens/s: " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()))
    print(f"best fixed depth: {best}; adaptive-cached / {best}: median "
          f"{result['cached_vs_best_fixed_median']:.3f} (per round "
          + ", ".join(f"{x:.2f}" for x in per_round) + f"); adaptive-fresh / {best}: median "
          f"{result['fresh_vs_best_fixed_median']:.3f}; adaptive-cached / no-spec: median "
          f"{result['cached_vs_no_spec_median']:.2f}; load average "
          + " ".join(f"{x:.2f}" for x in result["load_avg"]))


if __name__ == "__main__":
    main()

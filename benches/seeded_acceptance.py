"""What the seed guarantee costs: acceptance length of seeded requests (coupled draws) against
unseeded ones (rejection sampling), same prompts, same engine.

    .venv/bin/python benches/seeded_acceptance.py [--num-prompts 32] [--max-new-tokens 64]
        [--steps 3] [--temperature 1.0] [--drafters EAGLE,DRAFT] [--datasets code,prose,hard]
        [--engine-seed 0] [--threads 1] [--json]

For each drafter of the built-in models (the EAGLE head and the draft model) and each prompt set
(``benches/prompts/{code,prose,hard}.jsonl``, the same ``--num-prompts`` prompts each), one
engine with fixed ``--steps`` and ``--temperature`` generates every prompt twice: once with a
``seed`` per request (the drafter's proposal at each position uses that position's noise, and a
draft is accepted exactly when it equals the target's own seeded draw, see
``specdial.worker.sampling.speculative_accept``) and once without (rejection sampling, Leviathan
et al. 2023). Reported per row: acceptance length (tokens emitted per verify, bonus included:
sum over requests of ``spec_accept_length * spec_verify_ct`` / sum of ``spec_verify_ct``), the
verifies it is measured over, and the ratio seeded / unseeded. Rejection sampling's acceptance
is ``1 - TV(p, q)`` per draft; the coupled one is
``sum_x 1 / sum_y max(p(y)/p(x), q(y)/q(x))`` (tests/test_seeded_sampling.py), never higher.
No speed is measured.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from specdial.bench.datasets import build_requests
from specdial.engine import Engine


def acceptance_length(outputs: list[dict[str, Any]]) -> tuple[float, int]:
    """(tokens per verify over all requests, verifies) from ``Engine.generate`` outputs."""
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    tokens = sum(o["meta_info"]["spec_accept_length"] * o["meta_info"]["spec_verify_ct"]
                 for o in outputs)
    return (tokens / verifies if verifies else 0.0), verifies


def measure(drafter: str, dataset: str, args: argparse.Namespace) -> dict[str, Any]:
    """Seeded and unseeded acceptance length of one drafter on one prompt set."""
    prompts = [r.prompt for r in build_requests(dataset, args.num_prompts, seed=0)]
    base = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "ignore_eos": True}
    row: dict[str, Any] = {"drafter": drafter, "dataset": dataset, "prompts": len(prompts)}
    with Engine(model_path=None, speculative_algorithm=drafter, speculative_adaptive=False,
                speculative_num_steps=args.steps, max_running_requests=args.batch,
                log_interval_s=None, seed=args.engine_seed) as engine:
        for mode in ("seeded", "unseeded"):
            params = [{**base, "seed": 1000 + i} if mode == "seeded" else base
                      for i in range(len(prompts))]
            row[mode], row[f"{mode}_verifies"] = acceptance_length(
                engine.generate(prompts, params))
    row["ratio"] = row["seeded"] / row["unseeded"] if row["unseeded"] else None
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="fixed speculative_num_steps")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=16, help="max_running_requests")
    ap.add_argument("--drafters", default="EAGLE,DRAFT")
    ap.add_argument("--datasets", default="code,prose,hard")
    ap.add_argument("--engine-seed", type=int, default=0,
                    help="the engine generator's seed (the unseeded requests' draws)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(d, s, args) for d in args.drafters.split(",")
            for s in args.datasets.split(",")]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"acceptance length (tokens per verify), steps {args.steps}, temperature "
          f"{args.temperature}, {args.num_prompts} prompts x {args.max_new_tokens} tokens")
    print(f"{'drafter':8} {'dataset':8} {'seeded':>8} {'unseeded':>9} {'ratio':>6} "
          f"{'verifies (seeded/unseeded)':>28}")
    for r in rows:
        print(f"{r['drafter']:8} {r['dataset']:8} {r['seeded']:8.3f} {r['unseeded']:9.3f} "
              f"{r['ratio']:6.3f} {r['seeded_verifies']:>13d} / {r['unseeded_verifies']:<12d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

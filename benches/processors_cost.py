"""What the history-dependent sampling controls cost under speculation (issue 14).

    .venv/bin/python benches/processors_cost.py [--batch 16] [--num-prompts 32]
        [--max-new-tokens 64] [--steps 3] [--repetitions 3] [--threads 1] [--json]

1. End to end: one engine with the built-in models (EAGLE head, fixed ``--steps``) generates
   the same code prompts greedily (``ignore_eos``) with no controls, with ``min_tokens`` only
   (half the output), and with the three penalties (``repetition_penalty`` 1.1, ``presence_penalty`` 0.3,
   ``frequency_penalty`` 0.3), alternating round-robin over ``--repetitions``. Reported per
   mode: output tokens per second (median over repetitions) and its ratio to no controls, and
   the acceptance length (penalized greedy text is other text: its acceptance differs for that
   reason too). The draft pass of a batch with controls runs eagerly (no CUDA graph; on the CPU
   nothing is captured anyway).
2. The processing alone: :meth:`StepProcessing.verify` on random ``[B, steps + 1, V]`` logits
   of the target's vocabulary, penalties on every row, median wall time of 50 calls.

On a shared CPU the noise floor of part 1 is 10-30 % (BENCHMARKS.md section 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from specdial.bench.datasets import build_requests
from specdial.engine import Engine
from specdial.worker.processors import StepProcessing, TokenCounts
from specdial.worker.sampling import BatchSampling, SamplingParams

PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.3}


def modes(max_new_tokens: int) -> dict[str, dict[str, Any]]:
    """The compared controls (``min_tokens``: half the output)."""
    return {"none": {}, "min_tokens": {"min_tokens": max_new_tokens // 2},
            "penalties": PENALTIES}


def end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    prompts = [r.prompt for r in build_requests("code", args.num_prompts, seed=0)]
    base = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    compared = modes(args.max_new_tokens)
    speed: dict[str, list[float]] = {m: [] for m in compared}
    accept: dict[str, float] = {}
    with Engine(model_path=None, speculative_algorithm="EAGLE", speculative_adaptive=False,
                speculative_num_steps=args.steps, max_running_requests=args.batch,
                log_interval_s=None) as engine:
        engine.generate(prompts[:2], base)  # warm-up
        for _ in range(args.repetitions):
            for mode, extra in compared.items():
                started = time.perf_counter()
                out = engine.generate(prompts, {**base, **extra})
                seconds = time.perf_counter() - started
                speed[mode].append(sum(len(o["output_ids"]) for o in out) / seconds)
                verifies = sum(o["meta_info"]["spec_verify_ct"] for o in out)
                accept[mode] = sum(o["meta_info"]["spec_accept_length"]
                                   * o["meta_info"]["spec_verify_ct"] for o in out) / verifies
    base_speed = statistics.median(speed["none"])
    return {m: {"tokens_per_s": statistics.median(v),
                "ratio": statistics.median(v) / base_speed, "accept_length": accept[m]}
            for m, v in speed.items()}


def processing_only(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    b, n = args.batch, args.steps + 1
    params = [SamplingParams(**PENALTIES)] * b
    sampling = BatchSampling.from_params(params, prompt_lens=[64] * b,
                                         min_tokens_ids=[()] * b)
    assert sampling.processors is not None
    counts = TokenCounts(b, vocab, torch.device("cpu"))
    table = torch.randint(0, vocab, (b, 256))
    rows = np.arange(b)
    counts.catch_up(rows, np.full(b, 200), np.full(b, 64), table)
    base, seen = counts.gather(torch.from_numpy(rows))
    logits = torch.randn(b, n, vocab)
    ids = torch.randint(0, vocab, (b, n))
    step = StepProcessing(sampling.processors, torch.full((b,), 201), base, seen)
    times = []
    for _ in range(50):
        started = time.perf_counter()
        step.verify(logits, ids)
        times.append(time.perf_counter() - started)
    return {"batch": b, "columns": n, "vocab": vocab,
            "verify_processing_ms": 1e3 * statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    e2e = end_to_end(args)
    with Engine(model_path=None, log_interval_s=None) as engine:
        vocab = engine.target.config.vocab_size
    alone = processing_only(args, vocab)
    if args.json:
        print(json.dumps({"end_to_end": e2e, "processing": alone}, indent=2))
        return 0
    print(f"batch {args.batch}, steps {args.steps}, {args.num_prompts} prompts x "
          f"{args.max_new_tokens} tokens, {args.repetitions} repetitions")
    for mode, row in e2e.items():
        print(f"  {mode:>11}: {row['tokens_per_s']:8.1f} tokens/s  ratio {row['ratio']:.3f}  "
              f"acceptance length {row['accept_length']:.2f}")
    print(f"  StepProcessing.verify on [{alone['batch']}, {alone['columns']}, {alone['vocab']}]: "
          f"{alone['verify_processing_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

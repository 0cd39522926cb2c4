"""What per-request verify budgets save in the worker (issue 28): one decode iteration of the
built-in target and an EAGLE head at depth ``D`` over ``B`` requests, with every request at
budget ``D`` (what a padded verify costs, the cost of any heterogeneous batch before issue 28)
against the same batch with heterogeneous budgets (packed verify, draft levels per request).

    .venv/bin/python benches/verify_budgets_cost.py [--batch 16,64] [--depth 5] [--rounds 9]

The budgets are a fixed mix (a quarter each at 0, 1, ``D // 2`` and ``D``; mean about
``0.45 D``). Each round times ``--iters`` iterations of each configuration, alternating which
goes first; the figure is the median over rounds of the per-round ratio (budgets / padded)
of the mean seconds per iteration, with the tokens each verify runs beside it. The same
decode input is replayed every iteration (the drafter's state never needs a catch-up), so
the figure is the passes' cost alone, not a serving throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdial.builtin import builtin_model_path
from specdial.models import load_model
from specdial.models.drafter_loader import load_eagle_head
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.drafters import make_drafter
from specdial.worker.inputs import DecodeInput, PrefillInput
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.worker import SpecWorker

PROMPT = 96  # tokens per request's prompt
W = 256  # KV slots per row


def budget_mix(b: int, d: int) -> np.ndarray:
    """A quarter each at 0, 1, d // 2 and d."""
    return np.resize(np.array([0, 1, d // 2, d], np.int64), b)


def setup(b: int, d: int, drafter: str) -> tuple[SpecWorker, DecodeInput, DecodeInput]:
    target = load_model(builtin_model_path("target"))
    head = load_eagle_head(builtin_model_path(drafter), target)
    worker = SpecWorker(target, make_drafter(head, target, max_steps=d), b * W,
                        max_running_requests=b, context_length=W - d - 4, step_values=[d])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, target.config.vocab_size, (b, PROMPT))
    lens = np.full(b, PROMPT, np.int64)
    rows = np.arange(b, dtype=np.int64)
    sampling = BatchSampling.from_params([SamplingParams()] * b)
    with torch.inference_mode():
        worker.prefill(PrefillInput(rows, ids.reshape(-1), (rows[:, None] * W + np.arange(
            PROMPT)).reshape(-1), lens, lens, np.ones(b, np.int64), np.cumsum(lens) - 1),
            sampling, None)

    def decode_input(v: np.ndarray) -> DecodeInput:
        j = np.arange(d + 1)[None, :]
        loc = np.where(j <= v[:, None], rows[:, None] * W + PROMPT + j, worker.pad_kv_slot)
        return DecodeInput(d, None, rows, ids[:, -1].copy(), lens.copy(), loc.reshape(-1), v)

    return worker, decode_input(np.full(b, d, np.int64)), decode_input(budget_mix(b, d))


def timed(worker: SpecWorker, inp: DecodeInput, iters: int) -> float:
    sampling = BatchSampling.from_params([SamplingParams()] * len(inp.rows))
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(iters):
            worker.decode(inp, sampling, None)
        return (time.perf_counter() - start) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="16,64")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--drafter", default="eagle-weak", choices=("eagle", "eagle-weak"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for b in (int(x) for x in args.batch.split(",")):
        worker, padded, budgets = setup(b, args.depth, args.drafter)
        timed(worker, padded, 2), timed(worker, budgets, 2)  # warm-up
        ratios, secs = [], {"padded": [], "budgets": []}
        for r in range(args.rounds):
            order = [("padded", padded), ("budgets", budgets)][:: 1 if r % 2 == 0 else -1]
            got = {name: timed(worker, inp, args.iters) for name, inp in order}
            for name, s in got.items():
                secs[name].append(s)
            ratios.append(got["budgets"] / got["padded"])
        out[b] = {"depth": args.depth, "verify_tokens": {
                      "padded": int((padded.steps_per_request + 1).sum()),
                      "budgets": int((budgets.steps_per_request + 1).sum())},
                  "ms_per_iteration_median": {k: 1e3 * statistics.median(v)
                                              for k, v in secs.items()},
                  "ratio_budgets_over_padded_median": statistics.median(ratios),
                  "ratios": [round(x, 3) for x in ratios]}
        print(json.dumps({b: out[b]}), flush=True)


if __name__ == "__main__":
    main()

"""The target's tree verify with per-request node budgets, ragged against padded (issue 29 item
5), on the built-in target, CPU, one torch thread.

    .venv/bin/python benches/tree_ragged_cost.py [--kept 3,1,1,5,12,2,4,0] [--context 256]
        [--reps 9] [--json]

A batch of ``len(--kept)`` requests, each with ``--context`` cached tokens and a draft tree
compacted to ``N' = max(kept)`` nodes (a chain-shaped tree: node ``i``'s parent is ``i - 1``;
the mask's shape does not change the cost), verified in one target forward plus the logits:

- ``ragged``: request ``b`` runs its root and its ``kept[b]`` nodes (``sum(kept + 1)`` tokens,
  what ``tree_step._verify_ragged`` runs);
- ``padded``: every request runs ``N' + 1`` columns (``B (N' + 1)`` tokens, the compacted
  path before ragged packing).

Both arms run in every repetition, order alternating; timed by this thread's CPU clock
(``time.thread_time``: torch runs on this one thread, and a busy machine disturbs it far less
than wall time). Reported: per arm the median ms over ``--reps`` and the median of the paired
ratios padded / ragged, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from specdial.attention import TorchAttentionBackend
from specdial.builtin import builtin_model_path
from specdial.models import load_model
from specdial.models.batch import ForwardBatch


def verify_once(model, pool, backend, context: int, qo: np.ndarray, n: int) -> float:
    """Thread CPU seconds of one tree verify (forward + logits) with ``qo[b]`` columns per
    request over a square causal tree mask of ``n`` columns."""
    b = len(qo)
    kv = context + qo
    # request r's keys: its own block of context + n slots, the first kv[r] of them
    kv_idx = torch.from_numpy(np.concatenate([r * (context + n) + np.arange(k)
                                              for r, k in enumerate(kv)]))
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(b, n, n)
    meta = backend.plan(torch.from_numpy(qo), torch.from_numpy(kv), kv_idx, tree_mask=mask)
    pos = torch.from_numpy(np.concatenate([context + np.arange(q) for q in qo]))
    loc = torch.from_numpy(np.concatenate([r * (context + n) + context + np.arange(q)
                                           for r, q in enumerate(qo)]))
    ids = torch.randint(0, model.config.vocab_size, (int(qo.sum()),))
    t0 = time.thread_time()
    model.compute_logits(model(ForwardBatch(ids, pos, loc, meta), pool, backend))
    return time.thread_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kept", default="3,1,1,5,12,2,4,0")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    kept = np.array([int(x) for x in args.kept.split(",")], np.int64)
    n = int(kept.max()) + 1
    arms = {"ragged": kept + 1, "padded": np.full(len(kept), n, np.int64)}
    model = load_model(builtin_model_path("target"))
    pool = model.make_kv_pool(len(kept) * (args.context + n))
    backend = TorchAttentionBackend()
    load = os.getloadavg()
    times: dict[str, list[float]] = {a: [] for a in arms}
    with torch.inference_mode():
        for a, qo in arms.items():  # warm-up
            verify_once(model, pool, backend, args.context, qo, n)
        for r in range(args.reps):
            for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                times[a].append(verify_once(model, pool, backend, args.context, arms[a], n))
    out = {"kept": kept.tolist(), "tokens": {a: int(q.sum()) for a, q in arms.items()},
           "ms": {a: 1000 * statistics.median(v) for a, v in times.items()},
           "padded/ragged": statistics.median(x / y for x, y in zip(times["padded"],
                                                                    times["ragged"])),
           "reps": args.reps, "load_before": load, "load_after": os.getloadavg(),
           "raw_ms": {a: [1000 * x for x in v] for a, v in times.items()}}
    if args.json:
        print(json.dumps(out))
        return
    for a in arms:
        print(f"{a:7s} {out['tokens'][a]:4d} tokens  {out['ms'][a]:7.2f} ms (median thread CPU)")
    print(f"padded/ragged median paired ratio {out['padded/ragged']:.3f}; load {load} -> "
          f"{out['load_after']}")


if __name__ == "__main__":
    main()

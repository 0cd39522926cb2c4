"""Where one batch-1 chain iteration's CPU time goes (issues 29/32): model forwards or host work.

    .venv/bin/python benches/chain_split.py [--drafter DRAFT|EAGLE] [--config chain-3]
        [--reps 4] [--num-prompts 2] [--json]

Decodes ``--num-prompts`` code prompts ``--reps`` times through ``SpecWorker.decode`` as
``benches/tree_worker.py`` does (built-in target and drafter, greedy, float32, one torch
thread, 48 new tokens, a small slot allocator in place of the scheduler), timed by this
thread's CPU clock (``time.thread_time``). Each decode stage of
:mod:`specdial.worker.stages` (``prepare``, ``draft``, ``verify``, ``accept``, ``extend``), the
target's and the drafter's ``forward`` / ``compute_logits`` and the attention backend's
``plan`` are wrapped by timers that count only inside ``decode`` (prefills excluded). Reported
per iteration (ms): the whole decode loop, each of those, and the host work: everything that
is not a model forward or its logits (the timers' own cost, ~1 µs per call, is in it).
Stages nest the forwards (``verify`` holds the target's, ``draft`` the drafter's and the
catch-up's), plans sit in ``prepare`` (and in the extends). Run it with ``PYTHONPATH`` set to
another copy of the package to compare; speed is never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_worker as tw  # noqa: E402  (a sibling script: its decode loop and slot allocator)

from specdial.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specdial.bench.datasets import build_requests  # noqa: E402
from specdial.builtin import builtin_model_path  # noqa: E402
from specdial.models import load_model, load_tokenizer  # noqa: E402
from specdial.models.drafter_loader import load_drafter  # noqa: E402
from specdial.worker.drafters import make_drafter  # noqa: E402
from specdial.worker.worker import SpecWorker  # noqa: E402


class Timers:
    """Thread-CPU seconds per key, counted only while ``active`` (inside ``decode``)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.active = False

    def wrap(self, owner: type, name: str, key: str, only: object = None) -> None:
        """Replace ``owner.name`` by a timed call (only for the instance ``only`` if given)."""
        f = getattr(owner, name)

        def timed(obj, *a, **k):
            if not self.active or (only is not None and obj is not only):
                return f(obj, *a, **k)
            t0 = time.thread_time()
            try:
                return f(obj, *a, **k)
            finally:
                self.acc[key] = self.acc.get(key, 0.0) + time.thread_time() - t0
        setattr(owner, name, timed)

    def wrap_decode(self) -> None:
        dec = SpecWorker.decode

        def decode(obj, *a, **k):
            self.active = True
            try:
                return dec(obj, *a, **k)
            finally:
                self.active = False
        SpecWorker.decode = decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="DRAFT", choices=("DRAFT", "EAGLE"))
    ap.add_argument("--config", default="chain-3", help="tree_worker's config name")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_model(builtin_model_path("target"))
    tok = load_tokenizer(builtin_model_path("target"))
    path = builtin_model_path("draft" if args.drafter == "DRAFT" else "eagle")
    module = load_drafter(path, target)[1]
    worker = SpecWorker(target, make_drafter(module, target, max_steps=8), tw.SLOTS,
                        max_running_requests=1, context_length=2048, step_values=range(9))
    prompts = []
    for r in build_requests("code", args.num_prompts, seed=0):
        ids = tok.encode(r.prompt)
        prompts.append(list(getattr(ids, "ids", ids))[-256:])
    shape = tw.parse_config(args.config)
    t = Timers()
    for stage in ("prepare", "draft", "verify", "accept", "extend"):
        t.wrap(SpecWorker, stage, "stage " + stage)
    t.wrap(type(target), "forward", "model target forward", only=target)
    t.wrap(type(target), "compute_logits", "model target logits", only=target)
    t.wrap(type(module), "forward", "model drafter forward", only=module)
    t.wrap(type(module), "compute_logits", "model drafter logits", only=module)
    t.wrap(TorchAttentionBackend, "plan", "attention plans")
    t.wrap_decode()
    total, iters = 0.0, 0
    with torch.inference_mode():
        tw.generate(worker, prompts[0], shape, 8)  # warm-up
        t.acc.clear()
        for _ in range(args.reps):
            for p in prompts:
                _, v, s = tw.generate(worker, p, shape, args.max_new_tokens, time.thread_time)
                total, iters = total + s, iters + v
    ms = {k: 1000 * v / iters for k, v in sorted(t.acc.items())}
    model = sum(v for k, v in ms.items() if k.startswith("model"))
    out = {"drafter": args.drafter, "config": args.config, "iterations": iters,
           "ms_per_iter": 1000 * total / iters, "split_ms": ms, "model_ms": model,
           "host_ms": 1000 * total / iters - model, "loadavg": os.getloadavg()}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.drafter} {args.config}: {out['ms_per_iter']:.2f} ms per iteration "
          f"({iters} iterations), load {out['loadavg'][0]:.1f}")
    for k, v in ms.items():
        print(f"  {k:24s} {v:6.2f}")
    print(f"  model forwards + logits  {model:6.2f}; host work {out['host_ms']:6.2f}")


if __name__ == "__main__":
    main()

"""Where batch-1 assisted decoding spends its CPU time: specdial's arms against transformers'
assisted generation, split into target forward, draft forward and host work (issue 29).

    .venv/bin/python benches/assisted_split.py [--arms chain_adaptive,tree_adaptive,hf_default]
        [--dataset code] [--rounds 3] [--json]

The engines and prompts are ``benches/hf_assisted.py``'s (built-in target and draft model,
float32, one torch thread, greedy, 48 new tokens, ``tree_ab.PROMPTS``, one warm-up). Timers
wrap, on the live objects (nothing in the package is changed): the target's ``forward`` and
``compute_logits`` (``target``), the draft model's (``draft``), the attention backend's
``plan`` and the tree drafter's ``tree_kv_indices`` (``plans``, host work inside ``host``),
and specdial's loop iteration (``loop``) or transformers' ``generate`` (``loop``). ``host`` =
loop - target - draft: everything outside the two models' forwards and LM heads (specdial:
planning, sampling and acceptance, the policy, KV moves, the scheduler; transformers: its
candidate generator, logits processors, cache cropping, ...). Each timer reads this thread's
CPU clock (``time.thread_time``; specdial's loop runs in its own thread, timed there), so
other processes' load moves the figures less than wall time. Reported per arm: median over
``--rounds`` of CPU µs per output token of each part, acceptance length, tokens per CPU second
of the timed threads. Speed is never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_assisted  # noqa: E402
import tree_ab  # noqa: E402

PARTS = ("loop", "target", "draft", "plans")


class Clock:
    """Thread CPU seconds per part; nested calls of one part count once."""

    def __init__(self) -> None:
        self.s = {p: 0.0 for p in PARTS}
        self._open: set[str] = set()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if part in self._open:
                return fn(*a, **k)
            self._open.add(part)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.s[part] += time.thread_time() - t0
                self._open.discard(part)
        return timed


def _wrap_model(clock: Clock, part: str, model: Any) -> None:
    model.forward = clock.wrap(part, model.forward)
    if hasattr(model, "compute_logits"):
        model.compute_logits = clock.wrap(part, model.compute_logits)


def specdial_arm(arm: str, ids: list[list[int]], tokens: int) -> Callable[[], dict]:
    from specdial.worker import tree_draft

    args = argparse.Namespace(drafter="draft", cpu_threads=1, fixed_steps=3, topk=4,
                              num_draft_tokens=16, fixed_tree_tokens=8, concurrency=1)
    engine = tree_ab.build(arm, args)
    hf_assisted.specdial_run(engine, ids, tokens)  # warm-up
    clock = Clock()
    worker = engine.worker
    _wrap_model(clock, "target", worker.target)
    _wrap_model(clock, "draft", worker.drafter.module)
    worker.backend.plan = clock.wrap("plans", worker.backend.plan)
    tree_draft.tree_kv_indices = clock.wrap("plans", tree_draft.tree_kv_indices)
    engine._loop.step = clock.wrap("loop", engine._loop.step)

    def run() -> dict:
        clock.s = {p: 0.0 for p in PARTS}
        _, accept, outs = hf_assisted.specdial_run(engine, ids, tokens)
        return {"tokens": sum(map(len, outs)), "accept": accept, "s": dict(clock.s)}
    return run


def hf_arm(ids: list[list[int]], tokens: int) -> Callable[[], dict]:
    target, drafts, _ = hf_assisted.load_hf(["default"])
    draft = drafts["hf_default"]
    hf_assisted.hf_run(target, draft, ids, tokens)  # warm-up
    clock = Clock()
    _wrap_model(clock, "target", target)
    _wrap_model(clock, "draft", draft)
    target.generate = clock.wrap("loop", target.generate)

    def run() -> dict:
        clock.s = {p: 0.0 for p in PARTS}
        _, outs = hf_assisted.hf_run(target, draft, ids, tokens)
        return {"tokens": sum(map(len, outs)), "accept": None, "s": dict(clock.s)}
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default="chain_adaptive,tree_adaptive,hf_default")
    p.add_argument("--dataset", default="code", choices=tuple(tree_ab.PROMPTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    _, _, tok = hf_assisted.load_hf([])
    ids = [tok.encode(x) for x in tree_ab.PROMPTS[args.dataset]]
    arms = args.arms.split(",")
    runs = {a: (hf_arm(ids, args.tokens) if a.startswith("hf") else
                specdial_arm(a, ids, args.tokens)) for a in arms}
    load = os.getloadavg()
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            rows[a].append(runs[a]())
    out: dict = {"load_before": load, "load_after": os.getloadavg(), "arms": {}}
    for a, rs in rows.items():
        per_tok = {part: statistics.median(1e6 * x["s"][part] / x["tokens"] for x in rs)
                   for part in PARTS}
        per_tok["host"] = statistics.median(
            1e6 * (x["s"]["loop"] - x["s"]["target"] - x["s"]["draft"]) / x["tokens"]
            for x in rs)
        acc = [x["accept"] for x in rs if x["accept"] is not None]
        out["arms"][a] = {"us_per_token": {k: round(v, 1) for k, v in per_tok.items()},
                          "tokens_per_cpu_s": round(1e6 / per_tok["loop"], 1),
                          "accept": round(statistics.median(acc), 3) if acc else None}
    if args.json:
        print(json.dumps(out))
        return
    print(f"load {out['load_before']} -> {out['load_after']}")
    print("| arm | loop µs/token | target | draft | host (of it plans) | tokens/CPU s | accept |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for a, v in out["arms"].items():
        u = v["us_per_token"]
        print(f"| {a} | {u['loop']} | {u['target']} | {u['draft']} | {u['host']} "
              f"({u['plans']}) | {v['tokens_per_cpu_s']} | {v['accept']} |")


if __name__ == "__main__":
    main()

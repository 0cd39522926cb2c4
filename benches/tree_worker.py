"""Draft trees against chains at batch size 1 on the worker (issue 29), built-in models.

    .venv/bin/python benches/tree_worker.py [--drafters DRAFT,EAGLE] [--datasets code,prose]
        [--configs chain-3,chain-5,tree-2x4x8,tree-4x4x16] [--max-new-tokens 48]
        [--reps 5] [--threads 1] [--json]

Each configuration decodes one prompt at a time through ``SpecWorker`` directly (greedy,
float32, ``--threads`` torch threads): ``nospec`` (plain decoding, steps 0), ``chain-K``
(fixed ``K`` drafts, ``SpecWorker.decode``) and ``tree-KxDxN`` (topk ``K``, depth ``D``, ``N``
nodes; :func:`specdial.worker.tree_step.run_tree_iteration`). A small slot allocator stands in
for the Rust scheduler (the tree's plan fields are not wired to it yet), so no policy runs:
the figures compare fixed shapes. Repetitions alternate the configurations (config order
rotated each repetition); reported per configuration: median tokens/s over the repetitions,
its ratio to the median of ``nospec`` and of the best chain, acceptance length (tokens emitted
per verify) and ms per iteration, with the load average beside them; then the target's
forward cost at 1 .. 64 new tokens (``--cost-tokens``), the curve that decides whether a
tree's larger verify pays off on this hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from specdial.bench.datasets import build_requests
from specdial.builtin import builtin_model_path
from specdial.models import load_model, load_tokenizer
from specdial.models.drafter_loader import load_drafter
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.drafters import make_drafter
from specdial.worker.inputs import DecodeInput, PrefillInput
from specdial.worker.sampling_params import SamplingParams
from specdial.worker.tree_step import TreePlan
from specdial.worker.worker import SpecWorker

SLOTS = 4096


def parse_config(name: str) -> tuple[int, int, int, bool]:
    """``nospec`` -> (1, 0, 0); ``chain-K`` -> (1, K, K); ``tree-KxDxN`` -> (K, D, N);
    ``treepath-K`` -> (1, K, K) through the tree iteration (a topk-1 :class:`TreePlan`: a
    chain's model work, the tree's host work). The last field: whether the tree path runs."""
    if name == "nospec":
        return 1, 0, 0, False
    if name.startswith("chain-"):
        k = int(name[6:])
        return 1, k, k, False
    if name.startswith("treepath-"):
        k = int(name[9:])
        return 1, k, k, True
    if name.startswith("tree-"):
        k, d, n = (int(x) for x in name[5:].split("x"))
        return k, d, n, k > 1
    raise SystemExit(f"unknown config {name!r}: nospec, chain-K, treepath-K or tree-KxDxN")


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def generate(worker: SpecWorker, prompt: list[int], shape: tuple[int, int, int, bool],
             new_tokens: int, clock=time.perf_counter) -> tuple[int, int, float]:
    """Greedy decoding of one prompt; returns (tokens, verifies, seconds of the decode by
    ``clock``: wall time, or this thread's CPU time, which a busy machine disturbs far less
    than wall time when torch runs on this one thread)."""
    k, d, n, as_tree = shape
    free = list(range(SLOTS))[::-1]
    chain = [free.pop() for _ in prompt]
    p = np.asarray(prompt, np.int64)
    one = np.ones(1, np.int64)
    greedy = BatchSampling.from_params([SamplingParams()])
    first = worker.prefill(PrefillInput(np.zeros(1, np.int64), p, np.asarray(chain, np.int64),
                                        np.array([len(p)]), np.array([len(p)]), one,
                                        np.array([len(p) - 1])), greedy, None)
    out, verifies = [int(first.tokens[0])], 0
    start = clock()
    while len(out) < new_tokens:
        new = [free.pop() for _ in range(d + 1)]
        scratch = [free.pop() for _ in range(n if as_tree else 0)]
        extra = [free.pop() for _ in range(k * (d - 1))] if as_tree and k * (d - 1) > n else []
        L = np.array([len(chain)], np.int64)
        if not as_tree:
            plan = DecodeInput(d, None, np.zeros(1, np.int64), np.array([out[-1]]), L,
                               np.asarray(new, np.int64), np.array([d]))
        else:
            plan = TreePlan(np.zeros(1, np.int64), np.array([out[-1]]), L,
                            np.asarray(new, np.int64), np.asarray(scratch, np.int64), d, k, n,
                            np.asarray(extra, np.int64) if extra else None)
        res = worker.decode(plan, greedy, None)
        a = int(res.accepted[0])
        out.extend(res.tokens_of(0).tolist())
        chain.extend(new[: a + 1])
        free.extend(new[a + 1:] + scratch + extra)
        verifies += 1
    return len(out) - 1, verifies, clock() - start


def cost_curve(model, tokens: list[int], reps: int, context: int = 256,
               clock=time.perf_counter) -> dict[int, float]:
    """Median ms of one forward of ``model`` over ``n`` new tokens after ``context`` cached
    ones, per ``n`` in ``tokens`` (alternating the sizes each repetition; timed by
    ``clock``): the cost a tree's verify (``N + 1`` tokens) pays against a chain's
    (``steps + 1``)."""
    from specdial.attention import TorchAttentionBackend
    from specdial.models.batch import ForwardBatch

    backend = TorchAttentionBackend()
    pool = model.make_kv_pool(context + max(tokens))
    ids = torch.randint(0, model.config.vocab_size, (context + max(tokens),))
    times: dict[int, list[float]] = {n: [] for n in tokens}
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first round warms up
            for n in tokens:
                kv = torch.arange(context + n)
                meta = backend.plan(torch.tensor([n]), torch.tensor([context + n]), kv)
                pos = torch.arange(context, context + n)
                t0 = clock()
                model.compute_logits(model(ForwardBatch(ids[pos], pos, pos, meta), pool,
                                           backend))
                times[n].append(clock() - t0)
    return {n: 1000 * statistics.median(v[1:]) for n, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", default="DRAFT")
    ap.add_argument("--datasets", default="code,prose")
    ap.add_argument("--configs", default="nospec,chain-3,chain-5,tree-2x4x8,tree-4x4x16")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cost-tokens", default="1,2,4,8,16,32,64",
                    help="token counts of the target's forward cost curve ('' to skip)")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="decode time by wall clock or by this thread's CPU time (with "
                         "--threads 1 on a busy machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    shapes = {c: parse_config(c) for c in configs}
    tpath = builtin_model_path("target")
    target = load_model(tpath)
    tok = load_tokenizer(tpath)
    rows = []
    for drafter_name in args.drafters.split(","):
        path = builtin_model_path("draft" if drafter_name == "DRAFT" else "eagle")
        drafter = make_drafter(load_drafter(path, target)[1], target, max_steps=8)
        worker = SpecWorker(target, drafter, SLOTS, max_running_requests=1,
                            context_length=2048, step_values=range(9))
        for dataset in args.datasets.split(","):
            prompts = []
            for r in build_requests(dataset, args.num_prompts, seed=0):
                ids = tok.encode(r.prompt)
                prompts.append(list(getattr(ids, "ids", ids))[-256:])
            stats = {c: {"tps": [], "tokens": 0, "verifies": 0, "secs": 0.0} for c in configs}
            with torch.inference_mode():
                generate(worker, prompts[0], shapes[configs[-1]], 8)  # warm-up
                for rep in range(args.reps):
                    order = configs[rep % len(configs):] + configs[: rep % len(configs)]
                    for c in order:
                        toks = verif = 0
                        secs = 0.0
                        for p in prompts:
                            t, v, s = generate(worker, p, shapes[c], args.max_new_tokens,
                                               CLOCKS[args.clock])
                            toks, verif, secs = toks + t, verif + v, secs + s
                        st = stats[c]
                        st["tps"].append(toks / secs)
                        st["tokens"] += toks
                        st["verifies"] += verif
                        st["secs"] += secs
            med = {c: statistics.median(stats[c]["tps"]) for c in configs}
            chains = [med[c] for c in configs if c.startswith("chain-")]
            for c in configs:
                st = stats[c]
                rows.append({
                    "drafter": drafter_name, "dataset": dataset, "config": c,
                    "tokens_per_s": med[c],
                    "vs_nospec": med[c] / med["nospec"] if "nospec" in med else None,
                    "vs_best_chain": med[c] / max(chains) if chains else None,
                    "accept_length": st["tokens"] / st["verifies"],
                    "ms_per_iter": 1000 * st["secs"] / st["verifies"]})
    curve = (cost_curve(target, [int(x) for x in args.cost_tokens.split(",")], args.reps,
                        clock=CLOCKS[args.clock])
             if args.cost_tokens else {})
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": load, "reps": args.reps,
                          "target_forward_ms": curve}))
    else:
        print(f"reps {args.reps}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        for r in rows:
            print(f"{r['drafter']:6} {r['dataset']:6} {r['config']:14} "
                  f"{r['tokens_per_s']:8.1f} tok/s  x{r['vs_nospec'] or 0:.2f} nospec  "
                  f"x{r['vs_best_chain'] or 0:.2f} best chain  accept {r['accept_length']:.2f}"
                  f"  {r['ms_per_iter']:.1f} ms/iter")
        if curve:
            one = curve[min(curve)]
            print("target forward (context 256), ms and ratio to the smallest: " + ", ".join(
                f"{n}: {ms:.1f} (x{ms / one:.2f})" for n, ms in curve.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine tokens/s at tp 1 and tp 2 on this CPU, and the time per decode iteration rank 0
spends in collectives (issue 17). Built-in models, adaptive steps, greedy, 48 tokens
(``ignore_eos``), batch 1 and 8, best of 2 runs after a warm-up, one torch thread per rank.

Usage: ``nice -n 19 .venv/bin/python benches/tp_engine.py`` (~1 min).

"In collectives" is the time rank 0 spends inside all-reduce / all-gather / broadcast
(:class:`~specdial.distributed.group.CollectiveTimer`): the transfer plus the wait for the
slower rank to reach the same collective. "Per decode iteration" is wall time over decode
iterations (the prefills are included)."""

import sys
import time

import torch

import specdial

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "for i in range("]


def run(engine, n):
    prompts = [PROMPTS[i % 4] for i in range(n)]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t0)


torch.set_num_threads(1)
for n in (1, 8):
    e1 = specdial.Engine(log_interval_s=None)
    run(e1, n)
    r1 = max(run(e1, n) for _ in range(2))
    e1.shutdown()
    e2 = specdial.Engine(tp_size=2, log_interval_s=None)
    run(e2, n)
    tp = e2._tp.tp
    tp.timer.reset()
    tp.timer.enabled = True
    it0 = e2._loop._decode_iters
    t0 = time.perf_counter()
    r2 = max(run(e2, n) for _ in range(2))
    wall = time.perf_counter() - t0
    iters = e2._loop._decode_iters - it0
    tp.timer.enabled = False
    e2.shutdown()
    print(f"batch {n}: tp1 {r1:.1f} tok/s, tp2 {r2:.1f} tok/s (x{r2 / r1:.2f}); tp2 rank 0: "
          f"{1e3 * wall / iters:.1f} ms per decode iteration, {1e3 * tp.timer.seconds / iters:.1f} "
          f"ms in {tp.timer.calls / iters:.0f} collectives", flush=True)

"""The engine loop's per-iteration cost, old code against new, at batch sizes 1, 8 and 16.

    .venv/bin/python benches/overhead_ab.py --baseline /tmp/base/python [--concurrency 1,8,16]
        [--repeats 5] [--tokens 48] [--steps 3] [--out benches/results/overhead_ab.json]

``--baseline``: the ``python/`` folder of the code to compare with (e.g. ``git archive <commit>
python | tar -x -C /tmp/base``, plus this checkout's compiled ``_core`` copied into it when the
Rust side is unchanged); "new" is this checkout. Each measurement is its own process (the
package is picked by ``PYTHONPATH``), one torch thread, the built-in models (float32 CPU),
``--steps`` fixed speculative steps (``0``: the adaptive policy), ``c`` concurrent greedy
requests with short prompts (``max_running_requests = c``, ``ignore_eos``, ``--tokens``
each), after a warm-up; three ``generate`` calls are measured. Rounds alternate the order of
old and new per round; the medians over ``--repeats`` rounds are reported:

- ``ms_per_iteration``: wall time of the engine loop's ``step`` (schedule -> passes -> report ->
  chunks handed over), per iteration, prefills included;
- ``other_ms_per_iteration``: the same less the target's and the drafter's ``forward`` /
  ``compute_logits``: the host work around the model calls;
- ``loop_cpu_ms_per_iteration`` / ``other_cpu_ms_per_iteration``: the same two in the loop
  thread's CPU time (``time.thread_time``), far less sensitive to a loaded machine than wall
  time (time spent waiting for a core or for the GIL is not counted);
- ``cpu_ms_per_token``: the process's CPU time (every thread: the loop and the caller) over
  the output tokens, during the measured calls;
- ``tokens_per_s``.

Speed figures from a shared machine: compare the ratio, with the load average it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "for i in range(",
           "def add(a, b):\n    return", "# parse the arguments\n", "with open(path) as f:",
           "try:\n    import"]
KEYS = ("ms_per_iteration", "other_ms_per_iteration", "loop_cpu_ms_per_iteration",
        "other_cpu_ms_per_iteration", "cpu_ms_per_token", "tokens_per_s")


class _Timer:
    """Wall and thread-CPU seconds of the outermost wrapped calls (on the calling thread)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls, self._depth = 0, 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w0
                self.cpu += time.thread_time() - c0
                self.calls += 1
                self._depth -= 1
        return timed


def child(c: int, tokens: int, steps: int) -> dict[str, Any]:
    """One measurement in this process (the package on ``sys.path`` is the variant)."""
    from specdial.engine import Engine

    policy = ({"speculative_adaptive": True} if steps == 0 else
              {"speculative_adaptive": False, "speculative_num_steps": steps})
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(c)]
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=None, max_running_requests=c, context_length=512, cpu_threads=1,
                log_interval_s=None, **policy) as engine:
        engine.generate(prompts, sampling_params=sp)  # warm-up
        step, model = _Timer(), _Timer()
        worker, loop = engine.worker, engine._loop
        for m in [worker.target] + ([] if worker.drafter is None else [worker.drafter.module]):
            m.forward, m.compute_logits = model.wrap(m.forward), model.wrap(m.compute_logits)
        loop.step = step.wrap(loop.step)
        cpu0, t0, n = time.process_time(), time.perf_counter(), 0
        for _ in range(3):
            outs = engine.generate(prompts, sampling_params=sp)
            n += sum(o["meta_info"]["completion_tokens"] for o in outs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    iters = max(step.calls, 1)
    return {"ms_per_iteration": 1e3 * step.wall / iters,
            "other_ms_per_iteration": 1e3 * (step.wall - model.wall) / iters,
            "loop_cpu_ms_per_iteration": 1e3 * step.cpu / iters,
            "other_cpu_ms_per_iteration": 1e3 * (step.cpu - model.cpu) / iters,
            "cpu_ms_per_token": 1e3 * cpu / n, "tokens_per_s": n / wall, "iterations": iters}


def measure(python_dir: str, c: int, ns: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": python_dir}
    out = subprocess.run([sys.executable, __file__, "--child", str(c), "--tokens",
                          str(ns.tokens), "--steps", str(ns.steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the python/ folder of the old code")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=3, help="fixed steps; 0: adaptive")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child is not None:
        print(json.dumps(child(ns.child, ns.tokens, ns.steps)))
        return
    if not ns.baseline:
        ap.error("--baseline is required")
    variants = {"old": str(Path(ns.baseline).resolve()), "new": str(ROOT / "python")}
    sizes = [int(x) for x in ns.concurrency.split(",")]
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {v: {c: [] for c in sizes}
                                                       for v in variants}
    loads = [os.getloadavg()[0]]
    for r in range(ns.repeats):
        for c in sizes:
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for v in order:
                raw[v][c].append(measure(variants[v], c, ns))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{ns.repeats} done, load {loads[-1]:.2f}", file=sys.stderr)
    med = {v: {c: {k: statistics.median(x[k] for x in raw[v][c]) for k in KEYS}
               for c in sizes} for v in variants}
    print(f"load average (1 min) over the run: {min(loads):.2f} .. {max(loads):.2f}")
    print("| batch | metric | old | new | new / old |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for c in sizes:
        for k in KEYS:
            o, n = med["old"][c][k], med["new"][c][k]
            print(f"| {c} | {k} | {o:.3f} | {n:.3f} | {n / o:.3f} |")
    if ns.out:
        ns.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(ns).items()},
                                      "loads": loads, "raw": raw,
                                      "median": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()

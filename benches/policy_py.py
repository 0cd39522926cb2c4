"""Python-visible cost of the adaptive decision per decode iteration.

Times `get_steps_for_batch` + `on_verify_complete` (a numpy int64 array of 64 accepted counts)
through the compiled `specdial._core` policy and, in the same run and harness, the pure-Python
reference of the same rules (`tests/reference_policy.py`, the test oracle), alternating the two
over several rounds to cancel machine noise. Prints ns per iteration and the ratio.

``--clock wall`` (the default, what BENCHMARKS.md's figures used) times with
``time.perf_counter_ns``; ``--clock thread`` with ``time.thread_time_ns``, this thread's CPU
time, which the time spent waiting for a CPU on a busy machine does not inflate (issue 25: under
load averages of 8-13 on 2 cores the wall-clock harness read 4-10 us where it reads ~0.9 us
idle, and the ratio moved by 2x between runs).

Usage: .venv/bin/python benches/policy_py.py [--batch-size 64] [--iterations 20000] [--rounds 5]
                                             [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specdial import AdaptiveConfig, AdaptiveSpeculativeParams

# the pure-Python reference is a test oracle: it lives with the tests, not in the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_policy import RefParams  # noqa: E402


def make_accepted(batch_size: int, iterations: int, seed: int = 0) -> list[np.ndarray]:
    """Accepted-draft arrays cycling through a few distinct patterns (values 0..7)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 8, size=batch_size, dtype=np.int64) for _ in range(64)]


#: ``--clock`` choices: the nanosecond clock each one reads.
CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def run(params, accepted: list[np.ndarray], batch_size: int, iterations: int,
        clock=time.perf_counter_ns) -> float:
    """ns per iteration of (get_steps_for_batch, on_verify_complete), by ``clock``."""
    get_steps, on_verify = params.get_steps_for_batch, params.on_verify_complete
    n = len(accepted)
    start = clock()
    for i in range(iterations):
        steps = get_steps(batch_size)
        on_verify(np.minimum(accepted[i % n], steps), batch_size)
    return (clock() - start) / iterations


def run_minimum_only(accepted: list[np.ndarray], iterations: int,
                     clock=time.perf_counter_ns) -> float:
    """The harness's own cost (the np.minimum that keeps inputs valid), subtracted from both."""
    n = len(accepted)
    start = clock()
    for i in range(iterations):
        np.minimum(accepted[i % n], 3)
    return (clock() - start) / iterations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: time.perf_counter_ns (default); thread: this thread's CPU time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    clock = CLOCKS[args.clock]
    config = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1, 3, 5, 7], "update_interval": 1, "warmup_batches": 0}})
    canonical = json.loads(config.to_json())
    accepted = make_accepted(args.batch_size, args.iterations)
    compiled, reference, harness = [], [], []
    for _ in range(args.rounds):
        harness.append(run_minimum_only(accepted, args.iterations, clock))
        compiled.append(run(AdaptiveSpeculativeParams(3, config), accepted, args.batch_size,
                            args.iterations, clock))
        reference.append(run(RefParams(3, canonical), accepted, args.batch_size, args.iterations,
                             clock))
    h = statistics.median(harness)
    c, r = statistics.median(compiled) - h, statistics.median(reference) - h
    result = {"batch_size": args.batch_size, "compiled_ns": round(c, 1), "reference_ns": round(r, 1), "ratio": round(r / c, 2), "harness_ns": round(h, 1),
              "clock": args.clock}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"batch size {args.batch_size}, {args.iterations} iterations x {args.rounds} rounds "
              f"(medians, {args.clock} clock, harness {h:.0f} ns subtracted)")
        print(f"  compiled specdial._core : {c:8.0f} ns / iteration")
        print(f"  pure-Python reference   : {r:8.0f} ns / iteration")
        print(f"  ratio (reference / compiled): {r / c:.1f}x"
              f"  (without subtracting the harness: {(r + h) / (c + h):.1f}x)")


if __name__ == "__main__":
    main()

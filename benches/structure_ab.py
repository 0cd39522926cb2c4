"""Before/after figures of a restructuring: the Rust plan+report cost and the Python share of a
batch-1 iteration, alternated between two checkouts on the same machine.

    python3 benches/structure_ab.py BEFORE AFTER [--rounds 3] [--configs no-spec,fixed-3,adaptive]

``BEFORE`` and ``AFTER`` are checkouts of the repository (e.g. ``git worktree add ../before
<old main>`` and the merged tree), each with its own ``.venv`` holding its own build of
specdial (``pip install -e '.[test]'``). Each round runs, on one side and then the other (the
order swapped every round so that slow drifts of a shared machine fall on both):

1. ``cargo bench -p specdial-core --bench scheduler -- plan_report --warm-up-time 1
   --measurement-time 3`` in that checkout (criterion; ``CARGO_TARGET_DIR`` = its ``target/``),
   keeping criterion's point estimate of each ``plan_report*`` benchmark, in microseconds;
2. ``benches/iteration_profile.py --concurrency 1`` with that checkout's own ``.venv`` and its
   own copy of the script (which reaches into the engine's internals and so must match them),
   keeping per configuration the share of an iteration outside the model forwards
   (``1 - forwards_share``: the Rust scheduler and the Python worker and loop), the Python part
   alone (``other_share``) and milliseconds per iteration.

It prints the median over the rounds per side and the after/before ratio, and with ``--json``
writes every round's figures. Needs only the standard library (it runs under any Python 3.9+).
Exit status 1 when a step fails on a side (its output is printed). Issue 27; BENCHMARKS.md
section 9 describes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_UNITS = {"ps": 1e-6, "ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
_CRITERION = re.compile(r"(scheduler/plan_report\S*)\s+time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]")
_PROFILE_KEYS = ("outside_forwards", "other_share", "ms_per_iteration")


def parse_criterion(text: str) -> dict[str, float]:
    """``{benchmark id: point estimate in microseconds}`` from criterion's console output
    (``NAME time: [low unit est unit high unit]``; the name may end its own line). Raises
    ``ValueError`` for a unit criterion does not print."""
    out: dict[str, float] = {}
    for name, value, unit in _CRITERION.findall(text):
        if unit not in _UNITS:
            raise ValueError(f"criterion time unit {unit!r} not one of {sorted(_UNITS)}")
        out[name] = float(value) * _UNITS[unit]
    return out


def profile_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``{"CONFIG outside_forwards": share, "CONFIG other_share": share, "CONFIG
    ms_per_iteration": ms}`` from ``iteration_profile.py --output-json`` rows (one per config)."""
    out: dict[str, float] = {}
    for r in rows:
        out[f"{r['config']} outside_forwards"] = 1.0 - float(r["forwards_share"])
        out[f"{r['config']} other_share"] = float(r["other_share"])
        out[f"{r['config']} ms_per_iteration"] = float(r["ms_per_iteration"])
    return out


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run ``cmd`` in ``cwd``; its stdout and stderr together. Raises ``RuntimeError`` with the
    tail of the output when it fails."""
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {cwd} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return p.stdout


def measure(side: Path, configs: str) -> dict[str, float]:
    """One round on checkout ``side``: the criterion figures, then the profile's."""
    env = dict(os.environ, CARGO_TARGET_DIR=str(side / "target"))
    text = _run(["cargo", "bench", "-p", "specdial-core", "--bench", "scheduler", "--",
                 "plan_report", "--warm-up-time", "1", "--measurement-time", "3"], side, env)
    figures = {f"{k} (us)": v for k, v in parse_criterion(text).items()}
    if not figures:
        raise RuntimeError(f"no plan_report benchmark in the output of {side}:\n{text[-2000:]}")
    env.pop("CARGO_TARGET_DIR")
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "profile.json"
        _run([str(side / ".venv" / "bin" / "python"), "benches/iteration_profile.py",
              "--concurrency", "1", "--configs", configs, "--output-json", str(js)], side, env)
        figures.update(profile_figures(json.loads(js.read_text())))
    return figures


def summarize(rounds: dict[str, list[dict[str, float]]]) -> list[tuple[str, float | None,
                                                                        float | None]]:
    """``[(figure, median before, median after)]`` over the rounds (None where a side lacks
    the figure, e.g. a benchmark only one side has)."""
    names = sorted({k for side in rounds.values() for r in side for k in r})

    def med(side: str, k: str) -> float | None:
        vals = [r[k] for r in rounds[side] if k in r]
        return statistics.median(vals) if vals else None
    return [(k, med("before", k), med("after", k)) for k in names]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, help="checkout before the change (with its .venv)")
    ap.add_argument("after", type=Path, help="checkout after the change (with its .venv)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 1)")
    ap.add_argument("--configs", default="no-spec,fixed-3,adaptive",
                    help="iteration_profile.py configurations")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, path in sides.items():
        if not (path / ".venv" / "bin" / "python").exists():
            ap.error(f"{name}: {path} has no .venv/bin/python")
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for name in order:
            print(f"round {i + 1}/{args.rounds}: {name} ({sides[name]})", file=sys.stderr,
                  flush=True)
            try:
                rounds[name].append(measure(sides[name], args.configs))
            except RuntimeError as e:
                print(e, file=sys.stderr)
                return 1
    print(f"| figure (median of {args.rounds}) | before | after | after / before |")
    print("|---|---:|---:|---:|")
    for k, b, a in summarize(rounds):
        ratio = a / b if a is not None and b else None
        print(f"| {k} | {_fmt(b)} | {_fmt(a)} | {_fmt(ratio)} |")
    if args.json:
        args.json.write_text(json.dumps({"sides": {k: str(v) for k, v in sides.items()},
                                         "rounds": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

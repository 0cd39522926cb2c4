"""Before/after A/B of the tree iteration's host work (issue 29), two checkouts, alternating.

    .venv/bin/python benches/tree_overhead_ab.py --base /path/to/base/python [--rounds 7]
        [--configs chain-3,treepath-3,tree-4x3x8] [--drafter DRAFT] [--json]

``--base``: a directory holding another copy of the ``specdial`` package (e.g. ``git archive
<commit> python/specdial | tar -x -C /tmp/base`` plus the compiled ``_core`` module copied
in). Each round runs ``benches/tree_worker.py`` (this checkout's script, built-in target,
greedy, float32, one torch thread, code prompts, 48 new tokens, timed by the thread's CPU
time unless ``--clock wall``) once per side in a fresh
process, the sides' order alternating per round, with ``PYTHONPATH`` pointing at the base
copy or at this checkout's ``python/``. Per round and side it records ms per iteration of
each configuration; ``treepath-K`` is a topk-1 tree of depth ``K`` through the tree
iteration (a chain's model work, the tree's host work), so ``treepath-K / chain-K`` is the
tree iteration's host overhead. Reported: per side the medians of ms/iteration and of the
paired within-process ratios to ``chain-K``, and the median of the paired new/base ratios
per configuration. Speed is never asserted; the load average is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_side(python_path: str, args: argparse.Namespace) -> dict[str, float]:
    """ms per iteration of each configuration, one ``tree_worker.py`` process."""
    env = dict(os.environ, PYTHONPATH=python_path)
    cmd = [sys.executable, str(ROOT / "benches" / "tree_worker.py"), "--drafters",
           args.drafter, "--datasets", args.dataset, "--configs", args.configs, "--reps",
           str(args.reps), "--num-prompts", str(args.num_prompts), "--max-new-tokens",
           str(args.max_new_tokens), "--cost-tokens", "", "--clock", args.clock, "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return {r["config"]: r["ms_per_iter"] for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="directory holding the base specdial package")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--configs", default="chain-3,treepath-3,tree-4x3x8")
    p.add_argument("--drafter", default="DRAFT", choices=("DRAFT", "EAGLE"))
    p.add_argument("--dataset", default="code")
    p.add_argument("--reps", type=int, default=2, help="tree_worker repetitions per process")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--clock", choices=("wall", "thread"), default="thread",
                   help="tree_worker's clock: this thread's CPU time (default; a busy machine "
                        "disturbs it far less) or wall time")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not (Path(args.base) / "specdial" / "__init__.py").is_file():
        p.error(f"--base: no specdial package under {args.base!r}")
    sides = {"base": args.base, "new": str(ROOT / "python")}
    configs = args.configs.split(",")
    chain = next((c for c in configs if c.startswith("chain-")), None)
    ms: dict[str, dict[str, list[float]]] = {s: {c: [] for c in configs} for s in sides}
    load = os.getloadavg()
    for r in range(args.rounds):
        for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
            for c, v in run_side(sides[side], args).items():
                ms[side][c].append(v)
    out: dict = {"args": vars(args), "load_before": load, "load_after": os.getloadavg(),
                 "ms_per_iter": {s: {c: statistics.median(v) for c, v in d.items()}
                                 for s, d in ms.items()},
                 "new_over_base": {c: statistics.median(
                     n / b for n, b in zip(ms["new"][c], ms["base"][c])) for c in configs},
                 "raw": ms}
    if chain:
        out["over_chain"] = {s: {c: statistics.median(x / y for x, y in zip(d[c], d[chain]))
                                 for c in configs} for s, d in ms.items()}
    if args.json:
        print(json.dumps(out))
        return
    for c in configs:
        line = (f"{c:14s} base {out['ms_per_iter']['base'][c]:6.2f} ms/it  new "
                f"{out['ms_per_iter']['new'][c]:6.2f} ms/it  new/base "
                f"{out['new_over_base'][c]:.3f}")
        if chain:
            line += (f"  /{chain}: base {out['over_chain']['base'][c]:.3f} new "
                     f"{out['over_chain']['new'][c]:.3f}")
        print(line)
    print(f"rounds {args.rounds}; load {load} -> {out['load_after']}")


if __name__ == "__main__":
    main()

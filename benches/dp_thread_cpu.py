"""Where a ``specdial serve`` process and its replica processes spend CPU per output token,
thread by thread (issue 32's HTTP path): the serving process's event loop (HTTP, the runs,
the router) and its replica reader threads, each replica's event loop (its calls) and engine
loop thread. With ``--baseline DIR`` the same for a server with ``PYTHONPATH=DIR`` (another
checkout's ``python`` directory, its ``_core`` built), the two alternating round by round.

Each round sends ``--requests`` concurrent greedy non-streaming ``/v1/completions`` of
``--tokens`` new tokens (benches/dp_processes.py's prompts and ``HttpRun``); a thread's CPU
seconds come from ``/proc/<pid>/task/<tid>/stat`` in 10 ms ticks, so the figures are the
totals over all rounds divided by all their tokens. Thread names come from ``py-spy dump``
when a ``py-spy`` executable is on ``PATH`` or given by ``--py-spy``; otherwise threads are
named by their ids. Speed is never asserted.

``--stream`` streams the requests instead (``stream: true``, ``include_usage``).

Usage: ``.venv/bin/python benches/dp_thread_cpu.py --dp 2 --fixed-steps 3 --repeats 6
[--stream] [--baseline DIR] [--out r.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dp_processes import HttpRun  # noqa: E402 - beside this script

TICK = os.sysconf("SC_CLK_TCK")


def processes(pid: int) -> list[tuple[str, int]]:
    """``[("server", pid), ("replica0", ...), ...]`` (the replicas: its child processes)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = f.read().split()
    return [("server", pid)] + [(f"replica{i}", int(k)) for i, k in enumerate(kids)]


def thread_names(pid: int, py_spy: str | None) -> dict[str, str]:
    """``{tid: Python thread name}`` of ``pid`` from ``py-spy dump`` (empty without it)."""
    if not py_spy:
        return {}
    out = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True,
                         text=True, timeout=60).stdout
    return dict(re.findall(r'Thread (\d+) \(\w+\): "([^"]+)"', out))


def thread_cpu(pid: int) -> dict[str, float]:
    """``{tid: user + system CPU seconds}`` of the threads of ``pid`` alive now."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def one_round(run: HttpRun, names: dict[tuple[str, str], str], tokens: int,
              stream: bool = False) -> tuple[dict[tuple[str, str], float], int]:
    """CPU seconds per ``(process, thread name)`` of one round, and its output tokens
    (``stream``: the requests streamed). Without py-spy's names a process's main thread (its
    event loop in the server and in a replica) is named ``main``, the others by id."""
    procs = processes(run.proc.pid)
    before = {p: thread_cpu(pid) for p, pid in procs}
    out = run.run(tokens, stream)
    cpu: dict[tuple[str, str], float] = collections.Counter()
    for p, pid in procs:
        for tid, s in thread_cpu(pid).items():
            name = names.get((p, tid), "main" if tid == str(pid) else f"tid {tid}")
            cpu[(p, name)] += s - before[p].get(tid, 0.0)
    return cpu, out["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--fixed-steps", type=int, default=None)
    ap.add_argument("--baseline", default=None, metavar="DIR")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"))
    ap.add_argument("--stream", action="store_true",
                    help="stream the requests (stream: true, include_usage)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    threads = 1 if ns.dp == 1 else None
    runs = {"new": HttpRun(ns.dp, threads, ns.requests, ns.fixed_steps)}
    if ns.baseline:
        runs["baseline"] = HttpRun(ns.dp, threads, ns.requests, ns.fixed_steps,
                                   {**os.environ, "PYTHONPATH": ns.baseline})
    cpu: dict = {k: collections.Counter() for k in runs}
    tokens: dict = {k: 0 for k in runs}
    result: dict = {"load_before": os.getloadavg(), "args": vars(ns)}
    try:
        names = {}
        for name, run in runs.items():
            run.run(8, ns.stream)  # warm-up: every thread exists after it
            names[name] = {(p, tid): n for p, pid in processes(run.proc.pid)
                           for tid, n in thread_names(pid, ns.py_spy).items()}
        order = list(runs)
        for rep in range(ns.repeats):
            for name in order[rep % len(order):] + order[:rep % len(order)]:
                got, n = one_round(runs[name], names[name], ns.tokens, ns.stream)
                tokens[name] += n
                cpu[name].update(got)
    finally:
        for run in runs.values():
            run.close()
    result["load_after"] = os.getloadavg()
    for name in runs:
        rows = {f"{p} {t}": 1000 * v / tokens[name]
                for (p, t), v in sorted(cpu[name].items()) if v > 0}
        result[name] = {"tokens": tokens[name], "ms_per_token": rows}
        print(f"[{name}] CPU ms per output token, all {ns.repeats} rounds:")
        for key, ms in rows.items():
            print(f"  {key:40s} {ms:.3f}")
        print(f"  {'total':40s} {sum(rows.values()):.3f}")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

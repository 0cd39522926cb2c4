"""Data-parallel replica processes on this machine (issue 32): output tokens/s of dp 1 against
dp 2 (one process per replica, one torch thread each), 16 concurrent greedy short-prompt
requests (the Python-heavy case), built-in models (7M target + EAGLE head, adaptive steps).

Configurations: ``dp1_1thread`` and ``dp1_2threads`` (one engine, ``cpu_threads`` 1 or 2),
``dp2_processes`` (``dp_size=2``, each replica one thread) and ``dp1_half_batch`` (one engine,
one thread, half the requests: what each dp 2 replica runs, so its CPU per token is what dp 2
would cost if the process split added nothing; ``split_cpu_over_half_batch`` is dp 2's CPU per
token over it). ``--baseline DIR`` adds ``dp2_baseline``: dp 2 with ``PYTHONPATH=DIR`` (another
checkout's ``python`` directory, its ``_core`` module built) and ``dp1_baseline`` (dp 1, one
thread, the same), for a paired before/after of a change to the serving path; run the other
arms from a copy too (``PYTHONPATH=NEWDIR ... --baseline OLDDIR``, both copies on one file
system). One process per arm: on the loaded VM single server processes of the same code read
5-25 % apart in CPU per token (BENCHMARKS.md), so a change of a few percent needs a paired
comparison inside one process. ``--configs`` runs only the configurations it names. Each configuration runs in its own
process, started once and kept warm, so that the repetitions can alternate: repetition ``r``
runs every configuration in turn (order rotated each repetition, and reversed every other
one), ``--repeats`` times; the
median tokens/s per configuration is reported with the ratio of dp 2 to the best dp 1. Two
paths, each with its own processes:

- ``engine``: ``Engine.generate`` with the list of prompts, in a runner process
  (``--runner``) this script starts and drives over stdin/stdout;
- ``http``: ``specdial serve`` subprocesses on free ports, the requests sent concurrently by
  this process (``/v1/completions``, ``httpx``), so the client never shares the server's GIL.

Greedy outputs of every configuration are compared (``identical``). Speed is never asserted;
the machine is shared, so report the load average beside the figures (printed at start and end).
Beside tokens/s, the CPU milliseconds per output token of each configuration's processes (router
and replicas; /proc) show what the process split costs in work, which other users' load moves
far less than it moves tokens/s; on the ``http`` path the serving process's own share (the
router, without its replica processes; with dp 1 the whole engine) is reported too.

``--stream`` adds, on the ``http`` path, a streamed arm of every configuration
(``<config>:stream``: ``stream: true`` with ``stream_options.include_usage``, served by the same
process as ``<config>``, so stream against non-stream compares within one process), the
streamed text checked against the non-streamed (``identical``), and the output tokens per SSE
event received (``median_tokens_per_event``: above the acceptance length when events carry
several decode iterations' tokens). ``--stream-intervals 4,8`` adds, with ``--stream`` on the
``http`` path, streamed arms ``dp1_1thread@siN:stream`` and ``dp2_processes@siN:stream``:
servers started with ``--stream-interval N`` (SGLang's flag), against the interval-1 arms of the
same run.

Usage: ``nice -n 19 .venv/bin/python benches/dp_processes.py [--repeats 5] [--stream]
[--out r.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:\n    def", "for i in range(",
           "def add(a, b):\n    return", "# parse the arguments\n", "with open(path) as f:",
           "try:\n    import"]
#: name -> (dp_size, cpu_threads, share of the requests)
CONFIGS = {"dp1_1thread": (1, 1, 1.0), "dp1_2threads": (1, 2, 1.0), "dp2_processes": (2, None, 1.0),
           "dp1_half_batch": (1, 1, 0.5)}


def own_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` alone (its threads, not its children;
    from /proc; 0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its descendants (from /proc; a
    figure of the work done that, unlike tokens/s, other users' load barely moves)."""
    total = own_cpu_seconds(pid)
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(cpu_seconds(int(c)) for c in f.read().split())
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return total


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def _fixed(steps: int | None) -> dict:
    return {} if steps is None else {"speculative_adaptive": False,
                                     "speculative_num_steps": steps}


def runner(dp: int, threads: int | None, requests: int, steps: int | None) -> None:
    """``--runner``: build the engine, then answer ``run TOKENS`` lines with JSON."""
    import specdial

    kw = ({} if threads is None else {"cpu_threads": threads}) | _fixed(steps)
    engine = specdial.Engine(dp_size=dp, max_running_requests=requests, log_interval_s=None,
                             **kw)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        tokens = int(line.split()[1])
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(_prompts(requests), params)
        seconds = time.perf_counter() - t0
        done = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(json.dumps({"tps": done / seconds, "ids": [o["output_ids"] for o in outs],
                          "tokens": done}), flush=True)
    engine.shutdown()


class EngineRun:
    """A runner process for one configuration (the ``engine`` path)."""

    def __init__(self, dp: int, threads: int | None, requests: int,
                 steps: int | None, env: dict | None = None) -> None:
        argv = [sys.executable, __file__, "--runner", "--dp", str(dp), "--requests",
                str(requests)] + ([] if threads is None else ["--threads", str(threads)])
        argv += [] if steps is None else ["--fixed-steps", str(steps)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        json.loads(self.proc.stdout.readline())

    def run(self, tokens: int) -> dict:
        cpu = cpu_seconds(self.proc.pid)
        self.proc.stdin.write(f"run {tokens}\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        out["cpu_s"] = cpu_seconds(self.proc.pid) - cpu
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpRun:
    """A ``specdial serve`` process for one configuration (the ``http`` path)."""

    def __init__(self, dp: int, threads: int | None, requests: int,
                 steps: int | None, env: dict | None = None, interval: int = 1) -> None:
        import httpx

        self.port = _free_port()
        argv = [sys.executable, "-m", "specdial.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--dp-size", str(dp), "--max-running-requests",
                str(requests), "--log-level", "warning", "--log-interval-s", "0"]
        argv += [] if threads is None else ["--cpu-threads", str(threads)]
        argv += [] if steps is None else ["--no-speculative-adaptive",
                                          "--speculative-num-steps", str(steps)]
        argv += [] if interval == 1 else ["--stream-interval", str(interval)]
        self.proc = subprocess.Popen(argv, env=env)
        self.url, self.requests = f"http://127.0.0.1:{self.port}", requests
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"specdial serve --dp-size {dp} did not start")
            time.sleep(1.0)

    def run(self, tokens: int, stream: bool = False) -> dict:
        """One round: the requests sent at once; ``stream``: as server-sent events
        (``stream_options.include_usage``), each response's text joined from its events and
        its tokens read from the usage of its last event; also ``events`` (SSE events with
        choices received, over all requests)."""
        import httpx

        async def one(c: httpx.AsyncClient, prompt: str) -> tuple[str, int, int]:
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True}
            if not stream:
                r = (await c.post(self.url + "/v1/completions", json=body)).json()
                return r["choices"][0]["text"], r["usage"]["completion_tokens"], 1
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            parts, usage, events = [], None, 0
            async with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise RuntimeError(f"stream error: {ev}")
                    if ev.get("usage"):
                        usage = ev["usage"]
                    if ev["choices"]:
                        events += 1
                        parts.append(ev["choices"][0]["text"])
            if usage is None:
                raise RuntimeError("the stream carried no usage")
            return "".join(parts), usage["completion_tokens"], events

        async def main() -> list[tuple[str, int, int]]:
            async with httpx.AsyncClient(timeout=600) as c:
                return await asyncio.gather(*(one(c, p) for p in _prompts(self.requests)))

        own, cpu = own_cpu_seconds(self.proc.pid), cpu_seconds(self.proc.pid)
        t0 = time.perf_counter()
        outs = asyncio.run(main())
        seconds = time.perf_counter() - t0
        done = sum(n for _, n, _ in outs)
        return {"tps": done / seconds, "ids": [t for t, _, _ in outs],
                "cpu_s": cpu_seconds(self.proc.pid) - cpu, "tokens": done,
                "server_cpu_s": own_cpu_seconds(self.proc.pid) - own,
                "events": sum(e for _, _, e in outs)}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def measure(path: str, ns: argparse.Namespace) -> dict:
    """Alternating repetitions of every configuration on ``path``; medians and ratios."""
    cls = EngineRun if path == "engine" else HttpRun
    configs = dict(CONFIGS)
    env = None
    if ns.baseline:
        configs["dp2_baseline"] = (2, None, 1.0)
        configs["dp1_baseline"] = (1, 1, 1.0)
        env = {**os.environ, "PYTHONPATH": ns.baseline}
    if ns.configs:
        configs = {n: c for n, c in configs.items() if n in ns.configs.split(",")}
    intervals = {}  # "<config>@siN" -> N: servers with --stream-interval N (streamed arms only)
    if ns.stream and path == "http" and ns.stream_intervals:
        for n in (int(x) for x in ns.stream_intervals.split(",")):
            for base in ("dp1_1thread", "dp2_processes"):
                if base in configs:
                    configs[f"{base}@si{n}"] = configs[base]
                    intervals[f"{base}@si{n}"] = n
    runs = {name: cls(dp, threads, max(1, int(ns.requests * share)), ns.fixed_steps,
                      env if name.endswith("_baseline") else None,
                      **({"interval": intervals[name]} if name in intervals else {}))
            for name, (dp, threads, share) in configs.items()}
    # arms: name -> (its process, streamed); --stream adds "<config>:stream" on the http path,
    # served by the same process as "<config>", so that the two compare within one process
    arms = {name: (r, False) for name, r in runs.items() if name not in intervals}
    if ns.stream and path == "http":
        arms |= {f"{name}:stream": (r, True) for name, r in runs.items()}
    try:
        outputs = {name: r.run(8, True)["ids"] if stream else r.run(8)["ids"]
                   for name, (r, stream) in arms.items()}  # warm-up
        tps: dict[str, list[float]] = {name: [] for name in arms}
        cpu_ms: dict[str, list[float]] = {name: [] for name in arms}
        server_ms: dict[str, list[float]] = {name: [] for name in arms}
        events: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        for rep in range(ns.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            # odd repetitions run backwards: each configuration follows a different one in
            # turn (a rotation alone keeps the cyclic order, so one configuration would always
            # run right after the same other one, and inherit its after-effects)
            for name in order[::-1] if rep % 2 else order:
                r, stream = arms[name]
                out = r.run(ns.tokens, True) if stream else r.run(ns.tokens)
                tps[name].append(out["tps"])
                cpu_ms[name].append(1000 * out["cpu_s"] / out["tokens"])
                if "server_cpu_s" in out:
                    server_ms[name].append(1000 * out["server_cpu_s"] / out["tokens"])
                if stream:
                    events[name].append(out["tokens"] / out["events"])
    finally:
        for r in runs.values():
            r.close()
    summary = _summary(tps, cpu_ms, server_ms, outputs)
    if any(events.values()):  # output tokens per SSE event with choices, per streamed arm
        summary["median_tokens_per_event"] = {n: statistics.median(v)
                                              for n, v in events.items() if v}
    return summary


def _summary(tps: dict[str, list[float]], cpu_ms: dict[str, list[float]],
             server_ms: dict[str, list[float]], outputs: dict[str, list]) -> dict:
    """Medians per configuration, and the ratios of those that ran (``--configs``)."""
    med = {name: statistics.median(v) for name, v in tps.items()}
    cpu = {n: statistics.median(v) for n, v in cpu_ms.items()}
    half = min(len(v) for v in outputs.values())  # the half batch runs the first prompts
    out = {"median_tps": med, "all_tps": tps, "median_cpu_ms_per_token": cpu,
           "all_cpu_ms_per_token": cpu_ms,
           "identical": len({json.dumps(v[:half]) for v in outputs.values()}) == 1}
    if any(server_ms.values()):  # the http path: the serving process's own share
        out["median_server_cpu_ms_per_token"] = {n: statistics.median(v)
                                                 for n, v in server_ms.items() if v}
        out["all_server_cpu_ms_per_token"] = server_ms
    tags = {"", ":stream"} | {n[n.index("@"):] for n in med if "@si" in n}
    for tag in sorted(tags):  # the streamed arms' ratio too (--stream, --stream-intervals)
        dp1 = [med[n + tag] for n in ("dp1_1thread", "dp1_2threads") if n + tag in med]
        if dp1 and "dp2_processes" + tag in med:
            out["dp2_over_best_dp1" + tag.replace(":", "_")] = (med["dp2_processes" + tag]
                                                                / max(dp1))
    if "dp1_half_batch" in cpu and "dp2_processes" in cpu:
        out["split_cpu_over_half_batch"] = cpu["dp2_processes"] / cpu["dp1_half_batch"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--paths", default="engine,http")
    p.add_argument("--fixed-steps", type=int, default=None,
                   help="fixed speculative_num_steps instead of the adaptive policy (each "
                   "replica adapts on its own timings, which differ on a loaded machine)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="also run dp 2 and dp 1 (one thread) with PYTHONPATH=DIR (another "
                   "checkout's python/ with its _core built) as dp2_baseline and dp1_baseline, "
                   "alternating with the others")
    p.add_argument("--configs", default=None,
                   help="comma-separated configurations to run (default: all; "
                   f"{', '.join(CONFIGS)}; dp2_baseline, dp1_baseline with --baseline)")
    p.add_argument("--stream", action="store_true",
                   help="on the http path, also run every configuration's requests streamed "
                   "(stream: true, include_usage) as '<config>:stream', in the same server "
                   "process, alternating with the others; the streamed text must equal the "
                   "non-streamed (identical)")
    p.add_argument("--stream-intervals", default=None, metavar="N,M",
                   help="with --stream: also streamed arms served with --stream-interval N")
    p.add_argument("--out", default=None)
    p.add_argument("--runner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.runner:
        runner(ns.dp, ns.threads, ns.requests, ns.fixed_steps)
        return
    result: dict = {"load_before": os.getloadavg(), "requests": ns.requests,
                    "tokens": ns.tokens, "repeats": ns.repeats, "fixed_steps": ns.fixed_steps}
    for path in ns.paths.split(","):
        result[path] = r = measure(path, ns)
        print(f"[{path}] " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in r["median_tps"].items())
              + (f"  dp2/best dp1 x{r['dp2_over_best_dp1']:.2f}" if "dp2_over_best_dp1" in r
                 else "")
              + (f"  streamed x{r['dp2_over_best_dp1_stream']:.2f}"
                 if "dp2_over_best_dp1_stream" in r else "") + f"  identical {r['identical']}"
              + "\n  CPU ms per output token (all processes): " + "  ".join(
                  f"{k} {v:.2f}" for k, v in r["median_cpu_ms_per_token"].items())
              + (f"  dp2 / half batch x{r['split_cpu_over_half_batch']:.2f}"
                 if "split_cpu_over_half_batch" in r else "")
              + ("\n  of which the serving process: " + "  ".join(
                  f"{k} {v:.3f}" for k, v in r["median_server_cpu_ms_per_token"].items())
                 if "median_server_cpu_ms_per_token" in r else "")
              + ("\n  output tokens per SSE event: " + "  ".join(
                  f"{k} {v:.2f}" for k, v in r["median_tokens_per_event"].items())
                 if "median_tokens_per_event" in r else ""), flush=True)
    result["load_after"] = os.getloadavg()
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

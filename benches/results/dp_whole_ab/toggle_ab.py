"""Paired A/B of whole delivery inside ONE serve process (toggle_serve.py flips it by SIGUSR1),
so that no between-process difference enters: `PYTHONPATH=python .venv/bin/python
benches/results/dp_whole_ab/toggle_ab.py DP REPS` (ABBA order, 48 tokens x 16 requests, fixed steps 3)."""
import os, signal, subprocess, sys, time, statistics
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import dp_processes as d
import httpx
dp, reps = int(sys.argv[1]), int(sys.argv[2])
port = d._free_port()
argv = [sys.executable, str(HERE / "toggle_serve.py"), "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dp-size", str(dp), "--max-running-requests", "16", "--log-level", "warning", "--log-interval-s", "0",
        "--no-speculative-adaptive", "--speculative-num-steps", "3"] + (["--cpu-threads", "1"] if dp == 1 else [])
run = object.__new__(d.HttpRun)
run.proc = subprocess.Popen(argv); run.url = f"http://127.0.0.1:{port}"; run.requests = 16
try:
    while True:
        try:
            if httpx.get(run.url + "/health", timeout=5).status_code == 200: break
        except httpx.HTTPError: pass
        time.sleep(1)
    run.run(8)
    whole = True
    res = {True: [], False: []}
    for rep in range(reps):
        for _ in range(2):
            o = run.run(48)
            res[whole].append((1000 * o["cpu_s"] / o["tokens"], 1000 * o["server_cpu_s"] / o["tokens"], o["tps"]))
            os.kill(run.proc.pid, signal.SIGUSR1); whole = not whole
            time.sleep(0.2)
        # next rep starts with the other mode (ABBA)
        os.kill(run.proc.pid, signal.SIGUSR1); whole = not whole
        time.sleep(0.2)
    for k, v in res.items():
        print(f"dp{dp}", "whole" if k else "per-iteration", "cpu ms/token median", round(statistics.median(a for a, _, _ in v), 3),
              [round(a, 2) for a, _, _ in v], "server-process median", round(statistics.median(b for _, b, _ in v), 3),
              "tps median", round(statistics.median(c for _, _, c in v)), flush=True)
finally:
    run.close()

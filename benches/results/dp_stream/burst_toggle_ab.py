"""Paired A/B of the engine loop's courier.burst() inside ONE dp-2 serve process tree: a
sitecustomize (toggle_sitecustomize.py, copied as sitecustomize.py into DIR) flips
specdial.engine.loop.burst between courier.burst and a no-op on SIGUSR1 in every process;
streamed rounds (16 x 48 tokens, fixed steps 3), ABBA, REPS rounds per mode; CPU of all
processes per output token. `BURST_TOGGLE=1 PYTHONPATH=DIR .venv/bin/python
benches/results/dp_stream/burst_toggle_ab.py REPS`"""
import os, signal, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import dp_processes as d

reps = int(sys.argv[1])
run = d.HttpRun(2, None, 16, 3)
def pids():
    with open(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children") as f:
        return [run.proc.pid] + [int(k) for k in f.read().split()]
try:
    run.run(8, True)
    on = True
    res = {True: [], False: []}
    def flip():
        global on
        for p in pids():
            os.kill(p, signal.SIGUSR1)
        on = not on
        time.sleep(0.3)
    for rep in range(reps):
        for _ in range(2):
            o = run.run(48, True)
            res[on].append((1000 * o["cpu_s"] / o["tokens"], 1000 * o["server_cpu_s"] / o["tokens"]))
            flip()
        flip()  # ABBA: the next repetition starts with the other mode
    for k, v in res.items():
        print("burst" if k else "no burst", "CPU ms/token median", round(statistics.median(a for a, _ in v), 3),
              [round(a, 2) for a, _ in v], "serving process", round(statistics.median(b for _, b in v), 3), flush=True)
    print("load", os.getloadavg())
finally:
    run.close()

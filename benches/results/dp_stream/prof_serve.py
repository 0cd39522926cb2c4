"""Run from the repository root: PYTHONPATH=python .venv/bin/python benches/results/dp_stream/prof_serve.py stream|whole DP ROUNDS [TAG]; profiles the serving process main thread (cProfile, thread CPU clock) over ROUNDS rounds of 16 requests x 48 tokens, fixed steps 3."""
"""cProfile the serving process's event-loop thread under streamed (or not) load."""
import pstats, signal, subprocess, sys, time, os
sys.path.insert(0, "benches")
import dp_processes as d
import httpx
mode, dp, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tag = sys.argv[4] if len(sys.argv) > 4 else ""
port = d._free_port()
out = f"/tmp/prof_{mode}_dp{dp}{tag}.pstats"
argv = [sys.executable, str(__import__("pathlib").Path(__file__).with_name("prof_main.py")), "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dp-size", str(dp), "--max-running-requests", "16", "--log-level", "warning", "--log-interval-s", "0",
        "--no-speculative-adaptive", "--speculative-num-steps", "3"] + (["--cpu-threads", "1"] if dp == 1 else [])
run = object.__new__(d.HttpRun)
run.proc = subprocess.Popen(argv, env={**os.environ, "PROF_OUT": out}); run.url = f"http://127.0.0.1:{port}"; run.requests = 16
try:
    while True:
        try:
            if httpx.get(run.url + "/health", timeout=5).status_code == 200: break
        except httpx.HTTPError: pass
        time.sleep(1)
    run.run(8, mode == "stream")
    os.kill(run.proc.pid, signal.SIGUSR1); time.sleep(0.3)
    tot = [0, 0, 0]
    for _ in range(reps):
        o = run.run(48, mode == "stream")
        tot[0] += o["server_cpu_s"]; tot[1] += o["tokens"]; tot[2] += o.get("events", 0)
    os.kill(run.proc.pid, signal.SIGUSR2); time.sleep(1.0)
    print(mode, dp, "server ms/token (profiled)", round(1000 * tot[0] / tot[1], 3), "tokens/event", round(tot[1] / max(1, tot[2]), 2))
finally:
    run.close()
p = pstats.Stats(out); p.sort_stats("tottime").print_stats(30)

"""Four warm load ramps of the default engine, traced: the engine's per-verify trace
(`ramp_trace4.jsonl`) and, per decode iteration in the same order, [followed a prefill, ramp
number] (`ramp_trace4_after_prefill.json`; ramp 0 is the warm-up). Issue 11, BENCHMARKS.md 10.

    taskset -c 0 nice -n -10 .venv/bin/python benches/results/cpu-2026-12-01f/ramp_trace4.py 4
"""
import asyncio, json, sys, torch
from pathlib import Path
from specdial.bench.datasets import build_requests
from specdial.bench.driver import EngineDriver, run_benchmark, ramp_concurrency
from specdial.bench.metrics import summarize
from specdial.engine import Engine
torch.set_num_threads(1)
tr = Path("ramp_trace4.jsonl"); tr.unlink(missing_ok=True)
e = Engine(model_path=None, max_running_requests=64, log_interval_s=None, record_trace=str(tr))
loop = e._loop; st_ = {"pre": False}; flags = []
rp, rd = loop._run_prefill, loop._run_decode
def run_prefill(plan, rids):
    st_["pre"] = True; return rp(plan, rids)
def run_decode(plan, rids, started):
    flags.append((st_["pre"], run_id[0])); st_["pre"] = False; return rd(plan, rids, started)
loop._run_prefill, loop._run_decode = run_prefill, run_decode
run_id = [0]
d = EngineDriver(e)
reqs = build_requests("code", 256, seed=0, keep=lambda r: d.prepare(r, 48))
params = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
asyncio.run(run_benchmark(d, reqs[:8], sampling_params=params, concurrency=4, progress=False))
for i in range(int(sys.argv[1])):
    run_id[0] = i + 1
    r = asyncio.run(run_benchmark(d, reqs, sampling_params=params, concurrency_schedule=ramp_concurrency(256, 64), progress=False))
    print(i, round(summarize([r])["output_throughput"]), flush=True)
e.shutdown()
json.dump(flags, open("ramp_trace4_after_prefill.json", "w"))

"""The load ramp, one process, alternating: fixed-3 (f3), the adaptive engine as on main (ad), and
the adaptive engine whose decode iterations right after a prefill iteration report no seconds to
the cost model (adc; an experiment, not in the engine). Issue 11, BENCHMARKS.md section 10.

    taskset -c 0 nice -n -10 .venv/bin/python benches/results/cpu-2026-12-01f/after_prefill_ab.py 7
"""
import asyncio, json, sys, time, statistics as st, torch
from collections import defaultdict, Counter
from specdial.bench.datasets import build_requests
from specdial.bench.driver import EngineDriver, run_benchmark, ramp_concurrency
from specdial.bench.metrics import summarize
from specdial.engine import Engine
torch.set_num_threads(1)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["f3", "ad", "adc"]
engines, drivers, steps = {}, {}, defaultdict(Counter)
def patch(name, e):
    loop = e._loop
    st_ = {"pre": False}
    rp, rd = loop._run_prefill, loop._run_decode
    sr = loop.sched.report
    def run_prefill(plan, rids):
        st_["pre"] = True
        return rp(plan, rids)
    def run_decode(plan, rids, started):
        steps[name][int(plan.steps)] += 1
        if name == "adc" and st_["pre"]:
            st_["pre"] = False
            sampling = loop._sampling_for(rids)
            out = loop.worker.decode(plan, sampling, loop.generator, loop._lp_rows)
            res = loop.sched.report(out.tokens, out.offsets, out.accepted)
            loop._decode_iters += 1
            loop._last_decode = (int(plan.steps), int(plan.graph_bs or plan.batch_size))
            return out, res
        st_["pre"] = False
        return rd(plan, rids, started)
    loop._run_prefill, loop._run_decode = run_prefill, run_decode
for n in names:
    kw = {} if n.startswith("ad") else dict(speculative_num_steps=int(n[1:]), speculative_adaptive=False)
    engines[n] = Engine(model_path=None, max_running_requests=64, log_interval_s=None, **kw)
    patch(n, engines[n])
    drivers[n] = EngineDriver(engines[n])
d0 = drivers[names[0]]
reqs = build_requests("code", 256, seed=0, keep=lambda r: d0.prepare(r, 48))
params = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
ramp = ramp_concurrency(256, 64)
for n in names:
    asyncio.run(run_benchmark(drivers[n], reqs[:8], sampling_params=params, concurrency=4, progress=False))
res = defaultdict(list)
for rep in range(REPS):
    order = names[rep % len(names):] + names[:rep % len(names)]
    for n in order:
        d = asyncio.run(run_benchmark(drivers[n], reqs, sampling_params=params, concurrency_schedule=ramp, progress=False))
        res[n].append(summarize([d])["output_throughput"])
        print(rep, n, round(res[n][-1]), flush=True)
base = names[0]
for n in names[1:]:
    r = [a / b for a, b in zip(res[n], res[base])]
    print(n, "/", base, [round(x, 3) for x in r], "median", round(st.median(r), 3))
for n in names:
    tot = sum(steps[n].values()); print(n, {k: round(v / tot, 3) for k, v in sorted(steps[n].items())})
for e in engines.values(): e.shutdown()

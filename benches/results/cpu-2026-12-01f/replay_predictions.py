"""Replay an engine trace through the default goodput policy with the trace's steps forced and
report the error of the cost model's prediction for each iteration's steps before it runs,
split by whether its (bucket, steps) cell had been measured before (issue 11, BENCHMARKS.md 10).

    .venv/bin/python benches/results/cpu-2026-12-01f/replay_predictions.py \
        benches/results/cpu-2026-12-01f/ramp_trace4.jsonl
"""
import json, sys, math, statistics as st
from specdial._core import AdaptiveSpeculativeParams, AdaptiveConfig
def bucket(b):
    if b<=2: return b
    p=b.bit_length()-1; lo=1<<p; mid=lo+lo//2
    return mid if b>=mid else lo
tr=[json.loads(l) for l in open(sys.argv[1])]
p=AdaptiveSpeculativeParams(3, AdaptiveConfig.default())
seen=set(); errs={True:[], False:[]}; rows=[]
for i,r in enumerate(tr):
    b=r["batch_size"]; k=r["steps"]
    d=p.decide(b, r["context_tokens"])
    g=p.goodput_state()
    pred=g["last_decision"]["predicted_seconds"]

    cell=(bucket(b),k)
    if k in pred:
        e=math.log(r["seconds"]/pred[k]); errs[cell in seen].append(e); rows.append((i,b,k,cell in seen,pred[k],r["seconds"]))
    seen.add(cell)
    acc=r["accepted"]; spr=r.get("steps_per_request")
    fed=[a for j,a in enumerate(acc) if spr is None or spr[j]==k]
    p.on_verify_complete(fed, b, seconds=r["seconds"], context_tokens=r["context_tokens"], steps=k)
for m in (True, False):
    v=errs[m]; print("measured" if m else "UNMEASURED", len(v), "median |log err| %.3f, median log err %.3f, p90 |err| %.3f" % (st.median(map(abs,v)), st.median(v), sorted(map(abs,v))[int(0.9*len(v))]))
for row in rows:
    if not row[3] and abs(math.log(row[5]/row[4]))>0.4: print("big miss", row)

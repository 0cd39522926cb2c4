"""Fresh chain_adaptive engines (``tree_ab.build``, policy cache off), each: one warm-up prompt,
then ``--reps`` x (6 code + 6 prose prompts), greedy, 48 tokens, batch 1; a trace per run and
one JSON line per run (CPU tokens/s, acceptance length, depth histogram, first 30 depths, the
policy's last decision). Run from the repository root."""
import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "benches"))
import tree_ab  # noqa: E402

torch.set_num_threads(1)
p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=3)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--out", required=True)
p.add_argument("--arm", default="chain_adaptive")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
ns = argparse.Namespace(drafter="draft", cpu_threads=1, topk=4, num_draft_tokens=16,
                        fixed_steps=3, fixed_tree_tokens=8)
sp = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
for run in range(a.runs):
    path = f"{a.out}/{a.arm}_{run}.jsonl"
    if os.path.exists(path):
        os.unlink(path)
    e = tree_ab.build(a.arm, ns, record_trace=path)
    e.generate(tree_ab.PROMPTS["code"][0], sp)
    c0, n, acc = time.process_time(), 0, collections.defaultdict(list)
    for _ in range(a.reps):
        for d in ("code", "prose"):
            for q in tree_ab.PROMPTS[d]:
                o = e.generate(q, sp)
                n += o["meta_info"]["completion_tokens"]
                acc[d].append(o["meta_info"].get("spec_accept_length") or 1.0)
    cpu = time.process_time() - c0
    g = e.stats().goodput
    e.shutdown()
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    h = collections.Counter(x["steps"] for x in recs)
    print(json.dumps({"run": run, "tok_per_cpu_s": round(n / cpu, 1),
                      "accept": {d: round(statistics.mean(v), 2) for d, v in acc.items()},
                      "hist": dict(sorted(h.items())), "first": [x["steps"] for x in recs[:30]],
                      "load": os.getloadavg()[0], "last_decision": g and g.get("last_decision"),
                      "acceptance": g and [round(x, 3) for x in g["acceptance"]]}), flush=True)

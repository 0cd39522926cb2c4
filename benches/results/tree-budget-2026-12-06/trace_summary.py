import json, statistics, sys
import specdial
from specdial.builtin import builtin_model_path
from specdial._core import AdaptiveConfig
sys.path.insert(0, "benches")
from tree_ab import PROMPTS
cfg = json.loads(AdaptiveConfig.default().to_json())
out = {}
for name, extra in (("tree_adaptive", {}), ("tree_budget", {"speculative_adaptive_config": {**cfg, "verify": "per_request", "min_survival": "auto"}})):
    path = f"/tmp/wt-c-trace-{name}.jsonl"
    e = specdial.Engine(model_path=None, draft_model_path=str(builtin_model_path("draft")), policy_cache=False,
                        log_interval_s=None, max_running_requests=1, kv_cache_tokens=4096, cpu_threads=1,
                        speculative_eagle_topk=4, speculative_num_draft_tokens=16, record_trace=path, **extra)
    for _ in range(2):
        for p in PROMPTS["code"][:3]:
            e.generate(p, {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True})
    e.shutdown()
    rows = [json.loads(x) for x in open(path)]
    trees = [r for r in rows if "tree_topk" in r]
    cut = [r for r in trees if "verified" in r]
    out[name] = {"verifies": len(rows), "tree_verifies": len(trees),
                 "steps_hist": {k: sum(r["steps"] == k for r in rows if "tree_topk" not in r) for k in range(8)},
                 "tree_shapes": sorted({(r["steps"], r["tree_topk"], r["tree_nodes"]) for r in trees}),
                 "chain_stop_verifies": sum("min_survival" in r and "tree_topk" not in r for r in rows),
                 "tree_cut_verifies": len(cut),
                 "mean_kept_over_N": statistics.mean(v / r["tree_nodes"] for r in cut for v in r["verified"]) if cut else None,
                 "min_survival": sorted({round(r["min_survival"], 3) for r in cut}),
                 "mean_accepted_tree": statistics.mean(a for r in trees for a in r["accepted"]) if trees else None}
print(json.dumps(out, indent=1))

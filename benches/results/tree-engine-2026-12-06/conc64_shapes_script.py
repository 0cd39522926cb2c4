"""Concurrency 64 with adaptive trees and --record-trace: which shapes the policy ran."""
import collections, json, sys
sys.path.insert(0, "/work/wt-c/benches")
import specdial, tree_ab
from specdial.builtin import builtin_model_path
path = sys.argv[1]
e = specdial.Engine(model_path=None, policy_cache=False, log_interval_s=None, max_running_requests=64,
                    kv_cache_tokens=256 * 64, cpu_threads=1, draft_model_path=str(builtin_model_path("draft")),
                    speculative_eagle_topk=4, speculative_num_draft_tokens=16, record_trace=path)
prompts = [tree_ab.PROMPTS["code"][i % 6] for i in range(64)]
sp = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
for _ in range(3):
    e.generate(prompts, sp)
e.shutdown()
by = collections.Counter()
for line in open(path):
    r = json.loads(line)
    bs = "64" if r["batch_size"] == 64 else "<64"
    by[(bs, r["steps"], r.get("tree_topk", 1), r.get("tree_nodes", r["steps"]))] += 1
for k, v in sorted(by.items()): print(f"batch {k[0]:>3} steps {k[1]} topk {k[2]} nodes {k[3]}: {v}")

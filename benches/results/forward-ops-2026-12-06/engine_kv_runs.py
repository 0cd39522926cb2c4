import argparse, collections, sys
sys.path.insert(0, "benches")
import tree_ab
from specdial.attention import torch_backend as tb
hits = collections.Counter()
orig = tb.TorchAttentionBackend.plan
def plan(self, qo, kv, idx, tree_mask=None):
    m = orig(self, qo, kv, idx, tree_mask)
    hits[(m.kv_run is not None, tree_mask is not None, m.batch_size)] += 1
    return m
tb.TorchAttentionBackend.plan = plan
ns = argparse.Namespace(cpu_threads=1, drafter="draft", fixed_steps=3, topk=4, num_draft_tokens=16, fixed_tree_tokens=8, concurrency=1)
for arm in ("chain_adaptive", "tree_adaptive"):
    e = tree_ab.build(arm, ns)
    hits.clear()
    tree_ab.run_once(e, tree_ab.PROMPTS["code"][:3], 48)
    print(arm, dict(hits))
    e.shutdown() if hasattr(e, "shutdown") else None

import sys, time, argparse
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import hf_assisted, tree_ab, torch
args = argparse.Namespace(drafter="draft", cpu_threads=1, fixed_steps=3, topk=4, num_draft_tokens=16, fixed_tree_tokens=8, concurrency=1)
engine = tree_ab.build("chain_adaptive", args)
ids = [engine.tokenizer.encode(p) for p in tree_ab.PROMPTS["code"][:6]]
import specdial.worker.draft_run as DR
acc = {}
T = time.thread_time
def choose(self, logits, i, input_ids):
    t = [T()]
    logits = logits.float(); t.append(T())
    top, tok = logits.max(-1); t.append(T())
    top, tok = logits.max(-1); t.append(T())
    l = torch.logsumexp(logits, -1); t.append(T())
    l = torch.logsumexp(logits, -1); t.append(T())
    conf = torch.exp(top - l); t.append(T())
    c = conf.nan_to_num_(0.0).clamp_(0.0, 1.0); t.append(T())
    self.conf_out[:, i].copy_(c); t.append(T())
    self.tokens.append(tok)
    for j, n in enumerate(("float", "max", "max2", "lse", "lse2", "exp", "nan_clamp", "copy")):
        acc[n] = acc.get(n, 0.0) + t[j + 1] - t[j]
    acc["n"] = acc.get("n", 0) + 1
    return tok
DR.DraftRun.choose = choose
hf_assisted.specdial_run(engine, ids, 48)
n = acc.pop("n"); print({k: round(v / n * 1e6, 1) for k, v in acc.items()}, n, torch.get_num_threads())

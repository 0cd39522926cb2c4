"""Thread-CPU sections of the engine loop at batch 1 (hf_assisted arms), model calls subtracted."""
import sys, time, json, argparse
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import hf_assisted, tree_ab, torch
torch.set_num_threads(1)
arm = sys.argv[1]; ds = sys.argv[2] if len(sys.argv) > 2 else "code"
args = argparse.Namespace(drafter="draft", cpu_threads=1, fixed_steps=3, topk=4,
                          num_draft_tokens=16, fixed_tree_tokens=8, concurrency=1)
engine = tree_ab.build(arm, args)
ids = [engine.tokenizer.encode(p) for p in tree_ab.PROMPTS[ds][:6]]
hf_assisted.specdial_run(engine, ids, 48)
acc = {}; model = [0.0]; cnt = {}
def wrap(name, fn, is_model=False):
    def w(*a, **k):
        t0 = time.thread_time(); m0 = model[0]
        try: return fn(*a, **k)
        finally:
            dt = time.thread_time() - t0
            if is_model: model[0] += dt
            else:
                acc[name] = acc.get(name, 0.0) + dt - (model[0] - m0); cnt[name] = cnt.get(name, 0) + 1
    return w
w, loop = engine.worker, engine._loop
for m in [w.target, w.drafter.module]:
    m.forward, m.compute_logits = wrap("m", m.forward, True), wrap("m", m.compute_logits, True)
for n in ("prepare", "draft", "verify", "accept", "extend", "decode", "prefill"):
    if hasattr(w, n): setattr(w, n, wrap("w." + n, getattr(w, n)))
w.backend.plan = wrap("plan", w.backend.plan)
for n in ("_after_report", "step", "_emit", "_run_decode", "_refresh_stats", "_flush", "_sampling_for", "_maybe_log"):
    if hasattr(loop, n): setattr(loop, n, wrap("loop." + n, getattr(loop, n)))
import specdial.engine.loop as LP
LP.check_stop_strings = wrap("stops", LP.check_stop_strings)
import specdial.worker.draft_run as DR, specdial.worker.worker as WW, specdial.worker.step_runner as SR
DR.DraftRun.choose = wrap("choose", DR.DraftRun.choose)
WW.speculative_accept = wrap("spec_accept", WW.speculative_accept)
ds = w.drafter_state
ds.catch_up = wrap("catch_up", ds.catch_up)
ds.after_verify = wrap("after_verify", ds.after_verify)
w.tables.write = wrap("tables.write", w.tables.write)
SR.StepRunner.prepare_decode = wrap("prepare_decode", SR.StepRunner.prepare_decode)
WW.worker_input = wrap("worker_input", WW.worker_input)
loop.sched = type("S", (), {"__init__": lambda s, i: setattr(s, "_i", i), "__getattr__": lambda s, k: (wrap("sched." + k, getattr(s._i, k)) if k in ("schedule", "report") else getattr(s._i, k))})(loop.sched)
toks = 0
for _ in range(3):
    r = hf_assisted.specdial_run(engine, ids, 48); toks += sum(len(o) for o in r[2])
it = cnt["loop.step"]
print(arm, ds, "iters", it, "tokens", toks, "accept %.2f" % r[1], "model ms/iter %.2f" % (model[0] / it * 1e3))
print({k: round(v / it * 1e3, 3) for k, v in sorted(acc.items())})
print("calls/iter", {k: round(v / it, 2) for k, v in sorted(cnt.items())})

import sys, time, json
sys.path.insert(0, "/work/wt-c/benches")
from overhead_ab import PROMPTS
from specdial.engine import Engine
c = int(sys.argv[1]); steps = int(sys.argv[2])
policy = ({"speculative_adaptive": True} if steps == 0 else {"speculative_adaptive": False, "speculative_num_steps": steps})
prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(c)]
sp = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
acc = {}; model = [0.0]; stack = []
def wrap(name, fn, is_model=False):
    def w(*a, **k):
        t0 = time.thread_time(); m0 = model[0]
        try: return fn(*a, **k)
        finally:
            dt = time.thread_time() - t0
            if is_model:
                if not stack or stack[-1] != "M":
                    model[0] += dt
            else:
                acc[name] = acc.get(name, 0.0) + dt - (model[0] - m0)
    return w
with Engine(model_path=None, max_running_requests=c, context_length=512, cpu_threads=1, log_interval_s=None, **policy) as engine:
    engine.generate(prompts, sampling_params=sp)
    w, loop = engine.worker, engine._loop
    for m in [w.target, w.drafter.module]:
        m.forward, m.compute_logits = wrap("m", m.forward, True), wrap("m", m.compute_logits, True)
    for n in ("prepare", "draft", "verify", "accept", "extend"):
        setattr(w, n, wrap("w." + n, getattr(w, n)))
    sched = loop.sched
    class S:
        def __init__(s, inner): s._i = inner
        def __getattr__(s, k):
            v = getattr(s._i, k)
            return wrap("sched." + k, v) if k in ("schedule", "report") else v
    loop.sched = S(sched)
    for n in ("_after_report", "step"):
        setattr(loop, n, wrap("loop." + n, getattr(loop, n)))
    import specdial.engine.loop as L
    L.check_stop_strings = wrap("stops", L.check_stop_strings)
    loop._sampling_for = wrap("sampling_for", loop._sampling_for)
    model[0] = 0.0
    for _ in range(3): engine.generate(prompts, sampling_params=sp)
    it = loop.turns
iters = acc["loop.step"]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
print(json.dumps({k: round(v * 1e3, 1) for k, v in sorted(acc.items())}), "model_ms", round(model[0]*1e3,1))

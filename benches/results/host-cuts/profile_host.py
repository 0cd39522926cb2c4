import cProfile, pstats, sys, time, io
sys.path.insert(0, "/work/wt-c/benches")
from overhead_ab import PROMPTS
from specdial.engine import Engine
c = int(sys.argv[1]); steps = int(sys.argv[2]); n = int(sys.argv[3]) if len(sys.argv) > 3 else 40
policy = ({"speculative_adaptive": True} if steps == 0 else {"speculative_adaptive": False, "speculative_num_steps": steps})
prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(c)]
sp = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
prof = cProfile.Profile(time.thread_time)
state = {"on": False}
def off(fn):
    def w(*a, **k):
        if state["on"]: prof.disable()
        try: return fn(*a, **k)
        finally:
            if state["on"]: prof.enable()
    return w
with Engine(model_path=None, max_running_requests=c, context_length=512, cpu_threads=1, log_interval_s=None, **policy) as engine:
    engine.generate(prompts, sampling_params=sp)
    worker, loop = engine.worker, engine._loop
    for m in [worker.target] + ([] if worker.drafter is None else [worker.drafter.module]):
        m.forward, m.compute_logits = off(m.forward), off(m.compute_logits)
    orig = loop.step
    cnt = [0]
    def step(*a, **k):
        state["on"] = True; cnt[0] += 1
        prof.enable()
        try: return orig(*a, **k)
        finally:
            prof.disable(); state["on"] = False
    loop.step = step
    for _ in range(3):
        engine.generate(prompts, sampling_params=sp)
s = io.StringIO()
st = pstats.Stats(prof, stream=s); print("iterations", cnt[0]); st.sort_stats("tottime").print_stats(n)
st.sort_stats("cumulative").print_stats(n)
print(s.getvalue())

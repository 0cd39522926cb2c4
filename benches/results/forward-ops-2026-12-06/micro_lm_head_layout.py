import torch, time, statistics, torch.nn.functional as F
torch.set_num_threads(1)
W=torch.randn(4096,256); Wt=W.t().contiguous()
for T in (1,4,8,16):
    x=torch.randn(T,256)
    r={"linear":[], "mm_t":[]}
    with torch.inference_mode():
        for rnd in range(7):
            for name,f in (("linear",lambda: F.linear(x,W)),("mm_t",lambda: torch.mm(x,Wt))):
                t=time.thread_time()
                for _ in range(200): f()
                r[name].append((time.thread_time()-t)/200*1e6)
    print(T, {k: round(statistics.median(v),1) for k,v in r.items()})

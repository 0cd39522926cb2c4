import torch, time, statistics, torch.nn.functional as F
torch.set_num_threads(1)
w=1+0.1*torch.randn(256)
def old(x): return w*(x*torch.rsqrt(x.pow(2).mean(-1,keepdim=True)+1e-6))
def new(x): return F.rms_norm(x,(256,),w,1e-6)
for T in (1,4,16):
    x=torch.randn(T,256)
    r={"old":[], "new":[]}
    with torch.inference_mode():
        for rnd in range(9):
            for name,f in (("old",old),("new",new)) if rnd%2 else (("new",new),("old",old)):
                t=time.thread_time()
                for _ in range(2000): f(x)
                r[name].append((time.thread_time()-t)/2000*1e6)
    print(T, {k: round(statistics.median(v),2) for k,v in r.items()}, "equal", torch.equal(old(x), new(x)))

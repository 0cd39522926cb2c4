import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(1)
L=8
shapes=[(512,256),(256,256),(1408,256),(256,704)]
W=[[torch.randn(o,i) for (o,i) in shapes] for _ in range(L)]
Wt=[[w.t().contiguous() for w in ws] for ws in W]
def bench(f, n=100):
    r=[]
    for _ in range(7):
        t=time.thread_time()
        for i in range(n): f(i)
        r.append((time.thread_time()-t)/n*1e6)
    return statistics.median(r)
with torch.inference_mode():
  for T in (1,4,8,16):
    xs=[torch.randn(T,i) for (o,i) in shapes]
    a=bench(lambda n: [F.linear(xs[j], W[n%L][j]) for j in range(4)])
    b=bench(lambda n: [torch.mm(xs[j], Wt[n%L][j]) for j in range(4)])
    print(T, "linear(W) per layer", round(a,1), "mm(Wt)", round(b,1))

import torch, time, statistics
torch.set_num_threads(1)
kb=torch.randn(8, 4100, 2, 64); vb=torch.randn(8,4100,2,64)
kvb=torch.randn(8,4100,2,2,64)
g=torch.randperm(4000)[:260].view(1,260)
flat=g.view(-1)
def bench(f, n=300):
    r=[]
    for _ in range(5):
        t=time.thread_time()
        for i in range(n): f(i)
        r.append((time.thread_time()-t)/n*1e6)
    return statistics.median(r)
with torch.inference_mode():
    print("index [g] k+v", bench(lambda i: (kb[i%8][g], vb[i%8][g])))
    print("index_select k+v", bench(lambda i: (kb[i%8].index_select(0,flat).view(1,260,2,64), vb[i%8].index_select(0,flat).view(1,260,2,64))))
    print("index_select kv joint", bench(lambda i: kvb[i%8].index_select(0,flat)))
    print("kv joint [g]", bench(lambda i: kvb[i%8][g]))
    q=torch.randn(1,4,1,64); k=torch.randn(1,2,260,64); v=torch.randn(1,2,260,64)
    import torch.nn.functional as F
    print("sdpa gqa", bench(lambda i: F.scaled_dot_product_attention(q,k,v,enable_gqa=True)))
    x=torch.randn(1,256); w=torch.ones(256)
    print("rms_norm F", bench(lambda i: F.rms_norm(x,(256,),w,1e-6)))
    print("rms manual", bench(lambda i: w*(x*torch.rsqrt(x.pow(2).mean(-1,keepdim=True)+1e-6))))

import time, torch
torch.set_num_threads(1)
def bench(fn, n=2000):
    fn(); ts = []
    for r in range(5):
        t0 = time.thread_time()
        for _ in range(n): fn()
        ts.append((time.thread_time() - t0) / n * 1e6)
    return round(min(ts), 1)
x = torch.randn(1, 4096)
conf = torch.zeros(1, 4)
print("max", bench(lambda: x.max(-1)))
print("lse", bench(lambda: torch.logsumexp(x, -1)))
print("argmax", bench(lambda: x.argmax(-1)))
print("float", bench(lambda: x.float()))
def ch():
    lg = x.float(); top, tok = lg.max(-1); c = torch.exp(top - torch.logsumexp(lg, -1)); conf[:, 0].copy_(c.nan_to_num_(0.0).clamp_(0.0, 1.0))
print("choose body", bench(ch))
def ch2():
    top, tok = x.max(-1); c = torch.exp(top - torch.logsumexp(x, -1))
print("max+lse+exp", bench(ch2))
def ch3():
    s = torch.softmax(x, -1); top, tok = s.max(-1)
print("softmax+max", bench(ch3))

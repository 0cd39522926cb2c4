# A one-off record (paths as used in that session: the baseline at /tmp/f/base/python, the new code in /work/wt-f/python): BENCHMARKS section XX, "per layer".
"""Old vs new per-layer host work at the engine's shapes, interleaved in one process."""
import time, statistics, sys
import torch, torch.nn.functional as F
sys.path.insert(0, "/tmp/f/base/python")
torch.set_num_threads(1)
from specdial.attention.torch_backend import TorchAttentionBackend as Old  # base code
del sys.modules["specdial"]
for k in list(sys.modules):
    if k.startswith("specdial"):
        del sys.modules[k]
sys.path.pop(0)
sys.path.insert(0, "/work/wt-f/python")
from specdial.attention.torch_backend import TorchAttentionBackend as New
from specdial.kv_pool import KVPool
import specdial.attention.torch_backend as nb
print(nb.__file__, Old.forward.__code__.co_filename)
pool = KVPool(8, 4096, 2, 64); pool.k_buffer.normal_(); pool.v_buffer.normal_()
def rms_old(x, w, eps=1e-5):
    dtype = x.dtype; h = x.to(torch.float32); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); return w * h.to(dtype)
def rms_new(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
for b, n in [(1, 4), (8, 4), (16, 4), (8, 1), (16, 1)]:
    kv = torch.full((b,), 80) ; qo = torch.full((b,), n)
    idx = torch.randperm(4000)[: int(kv.sum())]
    q = torch.randn(b * n, 4, 64); x = torch.randn(b * n, 256); w = torch.randn(256)
    mo, mn = Old().plan(qo, kv, idx), New().plan(qo, kv, idx)
    assert torch.equal(Old().forward(q, 0, pool, mo, 0.125), New().forward(q, 0, pool, mn, 0.125))
    res = {"old": [], "new": []}
    for r in range(40):
        for name, fn in (("old", lambda: (Old.forward(None, q, 0, pool, mo, 0.125), rms_old(x, w), rms_old(x, w))),
                         ("new", lambda: (New.forward(None, q, 0, pool, mn, 0.125), rms_new(x, w), rms_new(x, w)))) if r % 2 else \
                        (("new", lambda: (New.forward(None, q, 0, pool, mn, 0.125), rms_new(x, w), rms_new(x, w))),
                         ("old", lambda: (Old.forward(None, q, 0, pool, mo, 0.125), rms_old(x, w), rms_old(x, w)))):
            c0 = time.thread_time()
            for _ in range(50): fn()
            res[name].append((time.thread_time() - c0) / 50 * 1e6)
    o, nn_ = statistics.median(res["old"]), statistics.median(res["new"])
    print(f"batch {b:2d} x {n} queries, 80 keys: attention + 2 RMSNorm per layer: old {o:6.1f} us  new {nn_:6.1f} us  new/old {nn_/o:.2f}")

"""TorchAttentionBackend against a per-request reference loop."""

import dataclasses
import math

import pytest
import torch

from specdial.attention import AttentionMetadata, TorchAttentionBackend
from specdial.kv_pool import KVPool


def _reference(q, pool, layer, qo_lens, kv_lens, kv_indices, scale):
    out, qs, ks = [], 0, 0
    rep = q.shape[1] // pool.num_kv_heads
    for qo, kv in zip(qo_lens.tolist(), kv_lens.tolist()):
        slots = kv_indices[ks:ks + kv]
        k = pool.k_buffer[layer][slots].repeat_interleave(rep, 1)  # [kv, H, D]
        v = pool.v_buffer[layer][slots].repeat_interleave(rep, 1)
        for i in range(qo):
            pos = kv - qo + i
            s = torch.einsum("hd,khd->hk", q[qs + i], k[:pos + 1]) * scale
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[:pos + 1]))
        qs, ks = qs + qo, ks + kv
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("uniform", [False, True])
def test_matches_reference(heads, kv_heads, uniform):
    """Ragged query lengths, and uniform ones (a decode batch: ``dense`` metadata, the
    forward's packed layout, bitwise the padded one's output)."""
    torch.manual_seed(0)
    d, layers, slots = 16, 2, 64
    pool = KVPool(layers, slots, kv_heads, d)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    pool.k_buffer[:, pool.pad_slot] = float("nan")  # never read
    pool.v_buffer[:, pool.pad_slot] = float("nan")
    qo_lens = torch.tensor([2, 2, 2, 2, 2] if uniform else [3, 1, 5, 0, 2])
    kv_lens = torch.tensor([3, 7, 9, 4, 2])
    kv_indices = torch.randperm(slots)[: int(kv_lens.sum())]
    q = torch.randn(int(qo_lens.sum()), heads, d)
    backend = TorchAttentionBackend()
    meta = backend.plan(qo_lens, kv_lens, kv_indices)
    assert meta.qo_indptr.tolist() == ([0, 2, 4, 6, 8, 10] if uniform
                                       else [0, 3, 4, 9, 9, 11])
    assert meta.kv_indptr.tolist() == [0, 3, 10, 19, 23, 25]
    assert meta.dense is uniform
    padded = dataclasses.replace(meta, dense=False)
    scale = 1 / math.sqrt(d)
    for layer in range(layers):
        out = backend.forward(q, layer, pool, meta, scale)
        ref = _reference(q, pool, layer, qo_lens, kv_lens, kv_indices, scale)
        assert out.shape == q.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, backend.forward(q, layer, pool, padded, scale))


def test_kv_pool_write_and_nbytes():
    pool = KVPool(2, 8, 2, 4, dtype=torch.bfloat16)
    assert pool.k_buffer.shape == (2, 9, 2, 4)
    assert pool.nbytes == 2 * 2 * 9 * 2 * 4 * 2
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loc = torch.tensor([5, 0, pool.pad_slot])
    pool.write(1, loc, k, v)
    assert torch.equal(pool.k_buffer[1, 5], k[0].bfloat16())
    assert torch.equal(pool.v_buffer[1, 0], v[1].bfloat16())
    assert pool.k_buffer[0].abs().sum() == 0


def test_plan_rejects_bad_lengths():
    backend = TorchAttentionBackend()
    with pytest.raises(ValueError, match="qo_len <= kv_len"):
        backend.plan(torch.tensor([3]), torch.tensor([2]), torch.arange(2))
    with pytest.raises(ValueError, match="sum\\(kv_lens\\)"):
        backend.plan(torch.tensor([1]), torch.tensor([2]), torch.arange(3))
    meta = AttentionMetadata.from_lens(torch.tensor([1, 2]), torch.tensor([4, 2]), torch.arange(6))
    assert meta.kv_indptr.tolist() == [0, 4, 6] and meta.batch_size == 2


@pytest.mark.parametrize("qo", [1, 4])
def test_consecutive_slots_read_a_view_of_the_pool(qo):
    """A key table of consecutive slots (a lone request, as the page pool hands them out)
    reads K/V as a slice of the pool: the same output, bit for bit, as the gather."""
    torch.manual_seed(1)
    pool = KVPool(2, 64, 2, 16)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    backend = TorchAttentionBackend()
    q = torch.randn(qo, 8, 16)
    meta = backend.plan(torch.tensor([qo]), torch.tensor([9]), torch.arange(10, 19))
    assert meta.kv_run == (10, 19)
    gather = dataclasses.replace(meta, kv_run=None)
    for layer in range(2):
        out = backend.forward(q, layer, pool, meta, 0.25)
        assert torch.equal(out, backend.forward(q, layer, pool, gather, 0.25))
        ref = _reference(q, pool, layer, torch.tensor([qo]), torch.tensor([9]),
                         torch.arange(10, 19), 0.25)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    two = torch.tensor([2, 2])
    assert backend.plan(two, two, torch.arange(4)).kv_run == (0, 4)  # adjacent equal runs
    assert backend.plan(torch.tensor([1, 1]), torch.tensor([1, 3]),
                        torch.arange(4)).kv_run is None  # padded keys
    assert backend.plan(torch.tensor([1]), torch.tensor([3]),
                        torch.tensor([0, 2, 1])).kv_run is None  # not in order
    assert backend.plan(torch.tensor([1]), torch.tensor([3]),
                        torch.tensor([0, 1, 3])).kv_run is None  # a gap


@pytest.mark.parametrize("run", [True, False])
def test_draft_step_plans_equal_planned_steps(run):
    """At batch size 1 the chain's draft-step metadata derived from the verify's equals
    ``plan`` of each step's lengths (every field), with and without a consecutive slot run,
    and gives the same attention output; other batch sizes get None (planned per step)."""
    torch.manual_seed(1)
    backend, L, n = TorchAttentionBackend(), 9, 4
    slots = torch.arange(3, 3 + L + n) if run else torch.randperm(40)[:L + n]
    verify = backend.plan(torch.tensor([n]), torch.tensor([L + n]), slots)
    derived = backend.draft_step_plans(verify, n - 1)
    assert derived is not None and len(derived) == n - 1
    pool = KVPool(1, 48, 2, 8)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    for i, got in enumerate(derived):
        want = backend.plan(torch.tensor([1]), torch.tensor([L + i + 1]), slots[:L + i + 1])
        for f in dataclasses.fields(want):
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name
        q = torch.randn(1, 4, 8)
        assert torch.equal(backend.forward(q, 0, pool, got, 0.3),
                           backend.forward(q, 0, pool, want, 0.3))
    two = backend.plan(torch.tensor([n, n]), torch.tensor([L + n, L + n]), slots.repeat(2))
    assert backend.draft_step_plans(two, n - 1) is None
    assert backend.draft_step_plans(verify, n) is None

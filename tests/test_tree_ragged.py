"""Ragged tree verifies (issue 29 item 5): on the torch CPU path a request whose node budget
kept ``k`` of its tree's nodes puts ``k + 1`` tokens through the target (the root and its kept
nodes), not the batch's widest ``N' + 1``: the ragged tree-attention rule
(:mod:`specdial.attention.base`), its torch and flashinfer layouts, and through the worker the
tokens the target ran, greedy identity with target-only and the target / drafter KV."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdial.attention import TorchAttentionBackend
from specdial.attention.base import tree_key_mask
from specdial.kv_pool import KVPool
from tree_helpers import assert_tree_attention_matches_loop
from test_tree_step import SHAPES, assert_target_greedy_and_chain_kv, run


def test_ragged_tree_attention_matches_each_requests_own_tree():
    """Square mask ``[3, 5, 5]``, requests with 5, 2 and 1 queries: each query sees the
    prefix and ``m[b, i, :qo_b]`` of its own last ``qo_b`` keys, as a reference loop."""
    torch.manual_seed(0)
    heads, kv_heads, hd, slots = 4, 2, 8, 128
    pool = KVPool(1, slots, kv_heads, hd)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    n = 5
    tm = torch.rand(3, n, n) < 0.5
    tm |= torch.eye(n, dtype=torch.bool)  # a node sees itself
    qo, prefix = torch.tensor([5, 2, 1]), torch.tensor([3, 4, 2])
    kv = prefix + qo
    kv_indices = torch.randperm(slots)[: int(kv.sum())]
    q = torch.randn(int(qo.sum()), heads, hd)
    meta = TorchAttentionBackend().plan(qo, kv, kv_indices, tree_mask=tm)
    out = TorchAttentionBackend().forward(q, 0, pool, meta, 1 / math.sqrt(hd))
    assert out.shape == q.shape
    assert_tree_attention_matches_loop(out, q, pool, kv_indices, qo, kv, prefix, tm)
    with pytest.raises(ValueError, match=r"ragged: n == t, qo_len in 1..n"):
        tree_key_mask(torch.tensor([5, 0, 1]), kv, tm, int(kv.max()))
    with pytest.raises(ValueError, match=r"ragged: n == t"):
        tree_key_mask(torch.tensor([5, 2, 1]), kv, tm[:, :, :4], int(kv.max()))


def test_flashinfer_packed_mask_of_a_ragged_tree():
    """flashinfer's custom_mask of a ragged tree holds ``qo_b * kv_b`` entries per request
    (its padded query rows are no queries); computed without flashinfer."""
    from specdial.attention.flashinfer_backend import packed_custom_mask

    g = torch.Generator().manual_seed(3)
    qo, kv = torch.tensor([3, 1]), torch.tensor([5, 4])
    tm = torch.rand(2, 3, 3, generator=g) < 0.5
    got = packed_custom_mask(qo, kv, tm, "cpu")
    want = []
    for r in range(2):
        pre = int(kv[r] - qo[r])
        for i in range(int(qo[r])):
            want += [j < pre or bool(tm[r, i, j - pre]) for j in range(int(kv[r]))]
    assert got.tolist() == want


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_a_request_verifies_its_kept_nodes_plus_the_root(request, name, tiny, monkeypatch):
    """Node budgets that cut part-way (some requests keep fewer nodes than others): each tree
    verify runs ``sum(kept + 1)`` target tokens, fewer than ``B (N' + 1)`` in some iteration,
    and greedy output, target KV and drafter KV / EAGLE features equal target-only's."""
    import specdial.worker.tree_step as tree_step

    fx = request.getfixturevalue("tiny1") if name == "eagle" else tiny
    module = fx.eagle_noisy if name == "eagle" else fx.draft_noisy
    tokens = []
    real = tree_step.run_target

    def counting(target, drafter, batch, *a, **k):
        tokens.append(int(batch.input_ids.numel()))
        return real(target, drafter, batch, *a, **k)
    monkeypatch.setattr(tree_step, "run_target", counting)
    verified = []
    worker, chain, out, _ = run(fx.target, module, SHAPES, min_survival=0.05, verified=verified)
    assert_target_greedy_and_chain_kv(fx.target, worker, chain, out)
    assert len(tokens) == len(verified)
    want = [int((v + 1).sum()) for _, v in verified]
    assert tokens == want
    widest = [len(v) * (int(v.max()) + 1) for _, v in verified]
    assert any(t < w for t, w in zip(tokens, widest)), (tokens, widest)
    assert any(v.max() > 0 for _, v in verified), "some requests kept nodes"
    assert np.all(np.array(tokens) <= np.array(widest))

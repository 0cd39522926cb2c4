"""Draft trees (issue 29): the EAGLE-2 builder, the ancestor mask and tree attention, each
against a brute-force reference written with plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from specdial.attention import TorchAttentionBackend
from specdial.attention.base import tree_key_mask
from specdial.kv_pool import KVPool
from specdial.worker.tree import TreeExpansion, ancestor_mask, select_nodes, tree_positions

from tree_helpers import assert_tree_attention_matches_loop, valid_shapes


def _expand(b, v, topk, depth, seed, peaky=False):
    """Run TreeExpansion on random log-probs; return it, the per-level inputs and outputs."""
    g = torch.Generator().manual_seed(seed)
    exp = TreeExpansion(topk, depth)
    lp = (torch.randn(b, v, generator=g) * (8 if peaky else 1)).log_softmax(-1)
    fronts, masks = [exp.first(lp)], []
    for _ in range(depth - 1):
        masks.append((exp.feed_mask().clone(), exp.frontier_cand.clone()))
        lp = (torch.randn(b, topk, v, generator=g) * (8 if peaky else 1)).log_softmax(-1)
        fronts.append(exp.next(lp))
    return exp, fronts, masks


def _candidates(exp):
    tokens, scores, parents, depths = (torch.cat(t, 1) for t in zip(*exp._cand))
    return tokens, scores, parents, depths


@pytest.mark.parametrize("topk,depth,n", [s for s in valid_shapes() if s[0] in (1, 2, 5, 8)
                                          and s[1] in (1, 2, 4, 7)])
def test_builder_top_n_ancestor_closed(topk, depth, n):
    b, v = 3, 32
    exp, _, _ = _expand(b, v, topk, depth, seed=topk * 100 + depth * 10 + n, peaky=depth > 3)
    tokens, scores, parents, depths = _candidates(exp)
    tree, sel = exp.finish(n)
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (b, n)
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.int64
    assert tree.scores.dtype == torch.float32
    for r in range(b):
        c = scores.shape[1]
        # brute force: rank by (score desc, depth asc, index asc)
        order = sorted(range(c), key=lambda i: (-scores[r, i].item(), depths[r, i].item(), i))
        assert set(sel[r].tolist()) == set(order[:n])
        for i in range(n):
            p = tree.parents[r, i].item()
            cand = sel[r, i].item()
            assert tree.tokens[r, i] == tokens[r, cand]
            assert tree.scores[r, i] == scores[r, cand]
            if p < 0:
                assert tree.depths[r, i] == 1 and parents[r, cand] == -1
            else:  # ancestor-closed, parents first, depth + 1, the parent candidate's node
                assert 0 <= p < i and tree.depths[r, i] == tree.depths[r, p] + 1
                assert sel[r, p] == parents[r, cand]
                assert tree.scores[r, i] <= tree.scores[r, p]
        kids = [tree.parents[r].tolist().count(p) for p in range(-1, n)]
        assert max(kids) <= topk
        sibs = {}
        for i in range(n):  # siblings distinct, in decreasing score
            sibs.setdefault(tree.parents[r, i].item(), []).append(i)
        for group in sibs.values():
            toks = [tree.tokens[r, i].item() for i in group]
            assert len(set(toks)) == len(toks)
            sc = [tree.scores[r, i].item() for i in group]
            assert sc == sorted(sc, reverse=True)


def test_select_nodes_breaks_ties_towards_the_parent():
    # a child with probability 1 has its parent's score: the parent must still come first
    scores = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    depths = torch.tensor([[3, 2, 1, 1]])
    assert select_nodes(scores, depths, 2).tolist() == [[2, 1]]
    with pytest.raises(ValueError, match="num_draft_tokens must be in 1..4"):
        select_nodes(scores, depths, 5)


def test_feed_mask_matches_the_candidates_ancestors():
    b, v, k, d = 2, 16, 3, 5
    exp, _, masks = _expand(b, v, k, d, seed=1)
    _, _, parents, _ = _candidates(exp)
    fed = []  # candidate index of each fed node, feeding order
    for level, (mask, frontier) in enumerate(masks):
        fed_now = fed + [frontier]
        order = torch.cat(fed_now, 1)  # [B, K * (level + 1)]
        assert mask.shape == (b, k, k * (level + 1))
        for r in range(b):
            for i in range(k):
                anc, c = set(), frontier[r, i].item()
                while c >= 0:
                    anc.add(c)
                    c = parents[r, c].item()
                want = [order[r, j].item() in anc for j in range(order.shape[1])]
                assert mask[r, i].tolist() == want
        fed = fed_now


def test_ancestor_mask_brute_force():
    g = torch.Generator().manual_seed(0)
    b, n = 4, 40
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g))
                                                 for i in range(1, n)]) for _ in range(b)])
    m = ancestor_mask(parents)
    assert m.shape == (b, n + 1, n + 1) and m.dtype == torch.bool
    for r in range(b):
        for i in range(n + 1):
            want, c = {0}, i
            while c > 0:
                want.add(c)
                c = parents[r, c - 1].item() + 1
            assert {j for j in range(n + 1) if m[r, i, j]} == want
    depths = torch.ones(b, n, dtype=torch.int64)
    assert tree_positions(torch.tensor([5, 0, 7, 1]), depths)[:, :2].tolist() == [
        [5, 6], [0, 1], [7, 8], [1, 2]]


def test_tree_attention_matches_reference():
    torch.manual_seed(0)
    heads, kv_heads, hd, slots = 4, 2, 8, 128
    pool = KVPool(1, slots, kv_heads, hd)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    prefix = torch.tensor([3, 0, 9])
    n_q, t = 5, 6  # 5 queries, 6 tree keys (e.g. drafter level: earlier frontier + this one)
    tm = torch.rand(3, n_q, t) < 0.5
    qo = torch.full((3,), n_q)
    kv = prefix + t
    kv_indices = torch.randperm(slots)[: int(kv.sum())]
    q = torch.randn(int(qo.sum()), heads, hd)
    meta = TorchAttentionBackend().plan(qo, kv, kv_indices, tree_mask=tm)
    out = TorchAttentionBackend().forward(q, 0, pool, meta, 1 / math.sqrt(hd))
    assert_tree_attention_matches_loop(out, q, pool, kv_indices, qo, kv, prefix, tm)
    with pytest.raises(ValueError, match="qo_len == n"):
        tree_key_mask(torch.tensor([5, 4, 5]), kv, tm, int(kv.max()))
    with pytest.raises(ValueError, match="kv_len >= t"):
        tree_key_mask(qo, torch.tensor([3, 9, 9]), tm, 9)


def test_flashinfer_packed_custom_mask_layout():
    """The flattened custom_mask flashinfer's prefill wrapper takes (request, query, key;
    computed without flashinfer, which the CPU image lacks) against a loop."""
    from specdial.attention.flashinfer_backend import packed_custom_mask

    g = torch.Generator().manual_seed(3)
    qo, kv = torch.tensor([3, 3]), torch.tensor([5, 9])
    tm = torch.rand(2, 3, 4, generator=g) < 0.5
    got = packed_custom_mask(qo, kv, tm, "cpu")
    want = []
    for r in range(2):
        pre = int(kv[r]) - 4
        for i in range(3):
            want += [j < pre or bool(tm[r, i, j - pre]) for j in range(int(kv[r]))]
    assert got.dtype == torch.bool and got.tolist() == want


def test_expand_level_normalizes_raw_logits():
    from specdial.worker.tree import expand_level

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3, 20, generator=g) * 3
    logits[0, 1, :5] = -math.inf  # an EAGLE-3 style hole in the vocabulary
    parent = torch.randn(2, 3, generator=g)
    raw = expand_level(logits, parent, 4)
    norm = expand_level(logits.log_softmax(-1), parent, 4)
    assert torch.equal(raw[0], norm[0]) and torch.equal(raw[2], norm[2])
    torch.testing.assert_close(raw[1], norm[1])
    with pytest.raises(ValueError, match="topk must be in 1..20"):
        expand_level(logits, parent, 21)

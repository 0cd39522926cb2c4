"""Toy models for the draft-tree tests: a target and drafters that read the last two tokens.

The target's logits after a sequence ending ``(prev, last)`` are ``A[last] + B[prev]`` (so the
distribution at a tree node depends on its own path), a drafter's are ``C[prev, last]``
(a random drafter) or the target's plus noise (a good one). Everything is batched over rows.
"""

from __future__ import annotations

import torch

from specdial.worker.tree import DraftTree, TreeExpansion


class ToyLM:
    """Logits ``[..., V]`` of the next token from the last two tokens (int64 ``[...]``)."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0,
                 base: "ToyLM | None" = None, noise: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.a = torch.randn(vocab, vocab, generator=g) * scale
        self.b = torch.randn(vocab, vocab, generator=g) * scale
        if base is not None:  # a drafter near ``base``
            self.a = base.a + noise * self.a
            self.b = base.b + noise * self.b

    def __call__(self, prev: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.a[last] + self.b[prev]


def draft_tree(drafter: ToyLM, prev: torch.Tensor, last: torch.Tensor, topk: int, depth: int,
               num_nodes: int, grammar=None) -> DraftTree:
    """EAGLE-2 drafting of ``B`` trees rooted at ``last`` (``prev`` before it) with the toy
    drafter, through :class:`TreeExpansion` (one drafter call per level); ``grammar`` (a
    ``TreeGrammar``) masks each level's logits through the hooks the worker's drafting calls
    (``mask_root``, ``start_level`` / ``mask_level``)."""
    exp = TreeExpansion(topk, depth)
    logits = drafter(prev, last)
    front = exp.first(logits.log_softmax(-1) if grammar is None else grammar.mask_root(logits))
    parent_tok = last[:, None].expand_as(front)
    for _ in range(depth - 1):
        if grammar is not None:
            grammar.start_level(front, exp.frontier_parent)
        logits = drafter(parent_tok, front)
        new = exp.next(logits.log_softmax(-1) if grammar is None else grammar.mask_level(logits))
        parent_tok, front = front.gather(1, exp.frontier_parent), new
    return exp.finish(num_nodes)[0]


def column_logits(model: ToyLM, tree: DraftTree, prev: torch.Tensor,
                  last: torch.Tensor) -> torch.Tensor:
    """``[B, N + 1, V]``: the model at every verify column (root, nodes), on its own path."""
    pcol, _ = tree.columns()
    col_tok = torch.cat([last[:, None], tree.tokens], 1)
    col_prev = torch.where(pcol < 0, prev[:, None], col_tok.gather(1, pcol.clamp(min=0)))
    return model(col_prev, col_tok)


def valid_shapes(max_topk: int = 8, max_depth: int = 7, max_nodes: int = 64):
    """Every (topk, depth, N) the contract allows: depth <= N <= min(64, candidates)."""
    for k in range(1, max_topk + 1):
        for d in range(1, max_depth + 1):
            cands = k + (d - 1) * k * k
            for n in sorted({d, min(cands, max_nodes), (d + min(cands, max_nodes)) // 2}):
                if d <= n <= min(cands, max_nodes):
                    yield k, d, n


def assert_tree_attention_matches_loop(out: torch.Tensor, q: torch.Tensor, pool, kv_indices,
                                       qo, kv, prefix, tm: torch.Tensor) -> None:
    """Check a tree-attention output ``out`` ``[sum(qo), heads, hd]`` against a per-query loop:
    query ``i`` of request ``r`` sees its ``prefix[r]`` keys and the tree keys ``j`` with
    ``tm[r, i, j - prefix[r]]`` (KV of layer 0 of ``pool`` at ``kv_indices``, packed per
    request, ``kv[r]`` keys each; GQA heads repeated). A query seeing no key is skipped (its
    output is undefined)."""
    import math
    heads, hd = q.shape[1], q.shape[2]
    rep = heads // pool.k_buffer.shape[2]
    qs = ks = 0
    for r in range(len(qo)):
        sl = kv_indices[ks:ks + int(kv[r])]
        k_ = pool.k_buffer[0][sl].repeat_interleave(rep, 1)
        v_ = pool.v_buffer[0][sl].repeat_interleave(rep, 1)
        for i in range(int(qo[r])):
            vis = [j for j in range(int(kv[r])) if j < prefix[r] or tm[r, i, j - prefix[r]]]
            if not vis:
                continue
            s = torch.einsum("hd,khd->hk", q[qs + i], k_[vis]) / math.sqrt(hd)
            ref = torch.einsum("hk,khd->hd", s.softmax(-1), v_[vis])
            torch.testing.assert_close(out[qs + i], ref, rtol=1e-5, atol=1e-5)
        qs, ks = qs + int(qo[r]), ks + int(kv[r])

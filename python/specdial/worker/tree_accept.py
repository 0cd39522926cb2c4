"""Lossless acceptance of a draft tree (issue 29): walk from the root down the accepted path.

Inputs are the verify forward's logits over the columns ``[root, node 0 .. node N-1]`` of each
request (:mod:`specdial.worker.tree`), already processed by the history-dependent processors
with *each column's own path* (penalties, ``min_tokens``: the distribution at a node depends on
the tokens on its path), and the tree. Three rules, chosen per row as in
:func:`specdial.worker.sampling.speculative_accept`:

- Greedy rows (invariant 1): at the current column take the target's argmax ``y``; if a child
  has token ``y`` move to it (an accepted draft), else stop and emit ``y`` (the correction, or
  the bonus token at a leaf). The emitted tokens are target-only greedy decoding's, whatever
  the tree.
- Seeded rows (coupled draws, :mod:`specdial.worker.seeded_noise`): the same walk with ``y``
  the target's own seeded draw ``argmax(p_c / E)``, ``E`` keyed (seed, sequence index of the
  token decided at column ``c``) = (seed, ``L + 1 + depth(c)``). The key depends on the
  position only, never on the column or the tree, so the emitted tokens are the seeded plain
  decoding tokens: independent of the tree's shape, the drafter and the batch.
- Unseeded sampling rows: recursive rejection over the deterministic children (SpecInfer's
  multi-round speculative sampling, Miao et al. 2024, arXiv 2305.09781, Algorithm 2; EAGLE's
  tree sampling, Li et al. 2024, with one-hot draft distributions because the top-k children
  are chosen deterministically). At a column with target distribution ``p`` and children
  ``x_1 .. x_m`` (distinct tokens, in decreasing draft probability), start with ``r_0 = p``;
  child ``x_i`` is accepted with probability ``r_{i-1}(x_i) / |r_{i-1}|``; on rejection
  ``r_i = r_{i-1}`` with ``x_i`` set to 0. If no child is accepted, emit a token drawn from
  ``r_m / |r_m|`` and stop; if ``x_i`` is accepted, continue at its column with a fresh
  ``r_0`` = that column's ``p``. Derivation (the rejection rule with ``q = onehot(x_i)``:
  ``min(1, r(x)/q(x)) = r(x)`` for normalized ``r``, residual ``norm(max(0, r - q))`` = ``r``
  with ``x`` zeroed): since ``|r_i| = |r_{i-1}| - p(x_i)``, the chance of reaching child
  ``i`` telescopes to ``prod_{j<i} |r_j| / |r_{j-1}| = |r_{i-1}|``, so ``x_i`` is emitted with
  probability ``|r_{i-1}| * p(x_i) / |r_{i-1}| = p(x_i)``, and a non-child ``y`` with
  ``|r_m| * p(y) / |r_m| = p(y)``: each emitted token is distributed exactly as ``p`` given
  its path. A residual of mass below 1e-6 (rounding only) falls back to ``p``.

Randomness of unseeded rows comes from ``generator`` in fixed amounts (``[B, D, K]`` uniforms,
then ``[B, V]`` exponentials), never per element. No host sync; the loops run over the ``D``
levels and ``K`` child ranks only.
"""

from __future__ import annotations

import torch

from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.sampling import sample_from_probs, target_probs
from specdial.worker.seeded_noise import PURPOSE_TOKEN, draw_keys, seeded_exponentials
from specdial.worker.tree import DraftTree, ancestor_mask

__all__ = ["child_table", "path_columns", "tree_accept"]

I64 = torch.int64
#: below this mass a residual is rounding noise: draw from ``p`` instead (sampling.py's bound)
RESIDUAL_EPS = 1e-6


def child_table(tree: DraftTree, check: bool = False) -> torch.Tensor:
    """``[B, N + 1, K]`` int64: the verify columns of each column's children in node order
    (decreasing draft probability), ``-1`` where it has fewer than ``K = tree.topk``. Trees
    from :func:`~specdial.worker.tree.build_tree` never have more than ``K`` children per
    node (tested); ``check=True`` verifies it for other trees (``ValueError``; one host
    sync, so not on the hot path)."""
    pcol, _ = tree.columns()
    b, cols = pcol.shape
    k = tree.topk
    node = torch.arange(cols, device=pcol.device)
    same = (pcol[:, :, None] == pcol[:, None, :]) & (node[None, None, :] < node[None, :, None])
    rank = same.sum(-1)  # siblings before each column
    if check and cols > 1 and bool((rank[:, 1:] >= k).any()):
        raise ValueError(f"tree_accept: a node has more than topk={k} children")
    table = torch.full((b, cols, k + 1), -1, dtype=I64, device=pcol.device)
    parent = pcol.clamp(min=0)
    slot = torch.where(pcol < 0, k, rank.clamp(max=k))  # the root (and overflow) spill
    table.view(b, -1).scatter_(1, parent * (k + 1) + slot, node.expand(b, cols))
    return table[:, :, :k]


def path_columns(path: torch.Tensor) -> torch.Tensor:
    """Columns ``[B, D + 1]`` int64 whose verify outputs decided the emitted tokens: the root
    (0), then the accepted path ``path`` ``[B, D]`` (``-1`` past it becomes the last accepted
    column, whose entries are never read). Gather logits with it for logprobs."""
    cols = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
    return torch.cummax(cols, 1).values  # node columns increase along a path


def tree_accept(tree: DraftTree, target_logits: torch.Tensor, sampling: BatchSampling,
                generator: torch.Generator | None, positions: torch.Tensor | None = None,
                ancestors: torch.Tensor | None = None, kept: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a path of each request's draft tree (rules: the module docstring).

    - ``tree``: ``B`` trees of ``N`` nodes, depth ``D``, at most ``K`` children per node.
    - ``target_logits`` ``[B, N + 1, V]`` float: column ``c`` is the target at the root
      (``c = 0``) or node ``c - 1``, processed with that column's own path.
    - ``positions`` ``[B]`` int64: sequence index of a depth-1 token (``L + 1``); required
      when ``sampling.any_seeded``.
    - ``ancestors`` ``[B, N + 1, N + 1]`` bool: :func:`~specdial.worker.tree.ancestor_mask`
      of ``tree.parents`` when the caller has it (the verify's tree mask), else built here.
    - ``kept`` ``[B, N]`` bool, ancestor-closed: the nodes each request verifies (per-request
      node budgets, :mod:`specdial.worker.tree_budget`); the others are never accepted and
      take no part in the residual rule (a fixed subset of the deterministic children, so
      each rule stays exact). None: every node.

    Returns ``(accepted [B] int64 in 0..D, path [B, D] int64, out_tokens [B, D + 1] int64)``:
    ``path[b, :accepted[b]]`` are the accepted nodes' verify columns (``-1`` after),
    ``out_tokens[b, :accepted[b] + 1]`` the emitted tokens (accepted drafts, then the
    correction or bonus token; ``-1`` after). Raises ``ValueError`` on inconsistent shapes.
    """
    b, n = tree.tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (b, n + 1):
        raise ValueError(f"tree_accept: target_logits must be [B={b}, N+1={n + 1}, V], got "
                         f"{list(target_logits.shape)}")
    if sampling.batch_size != b:
        raise ValueError(f"tree_accept: sampling has {sampling.batch_size} rows, tree has {b}")
    logits = target_logits.float()
    col_tokens = torch.cat([tree.tokens.new_full((b, 1), -1), tree.tokens], 1)
    choice = logits.argmax(-1)  # [B, N + 1]
    p = None
    if sampling.any_seeded:
        p = target_probs(logits, sampling)
        choice = _merge_rows(choice, _seeded_choice(tree, p, sampling, positions), sampling)
    if ancestors is None:
        ancestors = ancestor_mask(tree.parents)
    live = None if kept is None else torch.cat([kept.new_ones((b, 1)), kept], 1)  # [B, N + 1]
    accepted, path, last = _exact_walk(choice, tree, col_tokens, ancestors, live)
    if not sampling.all_greedy and sampling.any_unseeded:
        if p is None:
            p = target_probs(logits, sampling)
        children = child_table(tree)
        if live is not None:
            flat = children.clamp(min=0).view(b, -1)
            children = torch.where(live.gather(1, flat).view_as(children), children, -1)
        s_acc, s_path, s_last = _sampling_walk(p, children, col_tokens, tree.depth, generator)
        exact = sampling.greedy_mask if sampling.seeded_mask is None else (
            sampling.greedy_mask | sampling.seeded_mask)
        accepted = torch.where(exact, accepted, s_acc)
        path = torch.where(exact[:, None], path, s_path)
        last = torch.where(exact, last, s_last)
    return accepted, path, _emitted(col_tokens, path, accepted, last)


def _merge_rows(all_rows: torch.Tensor, seeded: torch.Tensor,
                sampling: BatchSampling) -> torch.Tensor:
    """``all_rows`` ``[B, ...]`` with the seeded rows replaced by ``seeded`` ``[S, ...]``."""
    if sampling.all_seeded:
        return seeded
    assert sampling.seeded_rows is not None
    return all_rows.index_copy(0, sampling.seeded_rows, seeded)


def _seeded_choice(tree: DraftTree, p: torch.Tensor, sampling: BatchSampling,
                   positions: torch.Tensor | None) -> torch.Tensor:
    """The seeded rows' own draws ``[S, N + 1]`` at every column: ``argmax(p_c / E)``, ``E``
    keyed (seed, ``positions + depth(c)``), the key of that sequence index in plain decoding."""
    if positions is None:
        raise ValueError("tree_accept: the batch has seeded rows, so positions (L + 1) are "
                         "required")
    assert sampling.seeds is not None
    _, depth = tree.columns()
    idx = positions.to(device=p.device, dtype=I64)[:, None] + depth  # [B, N + 1]
    seeds = sampling.seeds
    if not sampling.all_seeded:
        assert sampling.seeded_rows is not None
        idx = idx.index_select(0, sampling.seeded_rows)
        p = p.index_select(0, sampling.seeded_rows)
        seeds = seeds.index_select(0, sampling.seeded_rows)
    noise = seeded_exponentials(draw_keys(seeds, idx, PURPOSE_TOKEN), p.shape[-1])
    return (p / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)


def _exact_walk(choice: torch.Tensor, tree: DraftTree, col_tokens: torch.Tensor,
                ancestors: torch.Tensor, live: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy / seeded walk: follow the child equal to ``choice`` ``[B, N + 1]`` at each column.

    Done for all columns at once instead of level by level: a node *matches* when its token
    is its parent column's choice, and it is on the accepted path iff it and all its
    ancestors match (``ancestors`` ``[B, N + 1, N + 1]``, :func:`ancestor_mask`). Siblings
    hold distinct tokens (the top-k of one distribution), so at most one node per depth is
    on the path, and the path is the walk's. Returns ``(accepted [B], path [B, D] columns,
    -1 past the path; the choice at the path's last column [B])``. ``live`` ``[B, N + 1]``
    bool (or None: all): columns that may match (the kept nodes; the root is live).
    """
    pcol, depth = tree.columns()  # [B, N + 1] each; the root's parent column is -1
    match = col_tokens == choice.gather(1, pcol.clamp(min=0))
    match[:, 0] = True  # the root is always "accepted"
    if live is not None:
        match &= live
    on = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N + 1]
    levels = torch.arange(1, tree.depth + 1, device=choice.device)
    hit = on[:, :, None] & (depth[:, :, None] == levels)  # [B, N + 1, D]
    path = torch.where(hit.any(1), hit.to(torch.int8).argmax(1), -1)
    last_col = torch.where(on, depth, -1).argmax(1, keepdim=True)  # the deepest on the path
    return on[:, 1:].sum(-1), path, choice.gather(1, last_col).squeeze(1)


def _zero_out(r: torch.Tensor, x: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting child ``x`` ``[B]`` on the ``rejected`` rows: ``r`` with
    ``x`` set to 0 there (renormalization happens where ``r`` is read)."""
    keep = torch.ones_like(r).scatter_(1, x[:, None], (~rejected).to(r.dtype)[:, None])
    return r * keep


def _sampling_walk(p: torch.Tensor, children: torch.Tensor, col_tokens: torch.Tensor,
                   depth: int, generator: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unseeded rows: recursive rejection over the deterministic children (module docstring)."""
    b, _, v = p.shape
    k = children.shape[2]
    dev = p.device
    rows = torch.arange(b, device=dev)
    u = torch.rand((b, max(depth, 1), k), generator=generator, device=dev)
    cur = torch.zeros(b, dtype=I64, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    path = torch.full((b, depth), -1, dtype=I64, device=dev)
    final = p[:, 0].clone()  # the distribution the last token is drawn from
    for level in range(depth):
        r = p[rows, cur]  # [B, V]
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        for i in range(k):
            child = children[rows, cur, i]
            live = active & ~moved & (child >= 0)
            x = col_tokens.gather(1, child.clamp(min=0)[:, None]).squeeze(1).clamp(min=0)
            mass = r.sum(-1)
            take = live & (u[:, level, i] * mass < r.gather(1, x[:, None]).squeeze(1))
            nxt = torch.where(take, child, nxt)
            moved |= take
            r = _zero_out(r, x, live & ~take)
        stop = active & ~moved
        final = torch.where(stop[:, None], r, final)
        path[:, level] = torch.where(moved, nxt, -1)
        cur = nxt
        active = moved
    final = torch.where(active[:, None], p[rows, cur], final)  # all levels accepted: bonus
    final = torch.where(final.sum(-1, keepdim=True) > RESIDUAL_EPS, final, p[rows, cur])
    return (path >= 0).sum(-1), path, sample_from_probs(final, generator)


def _emitted(col_tokens: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
             last: torch.Tensor) -> torch.Tensor:
    """``[B, D + 1]``: the accepted path's tokens, then ``last``, then ``-1``."""
    b, depth = path.shape
    toks = col_tokens.gather(1, path.clamp(min=0))
    pos = torch.arange(depth + 1, device=path.device)
    drafts = torch.cat([toks, toks.new_full((b, 1), -1)], 1)
    acc = accepted[:, None]
    return torch.where(pos < acc, drafts, torch.where(pos == acc, last[:, None], -1))

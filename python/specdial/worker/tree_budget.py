"""Per-request node budgets of a draft tree (issue 29 item 5): a request's verify budget is its
node count.

With ``"verify": "per_request"`` and a ``min_survival`` key, a tree plan carries the threshold
the core chose (``rust/core/src/goodput/tree_plan.rs``, module docs). After drafting, request
``b`` keeps the nodes of its EAGLE-2 tree whose path confidence (``exp`` of the cumulative draft
log-probability :func:`~specdial.worker.tree_draft.draft_tree` computed, the same quantity the
chain's confidence stop thresholds, :mod:`specdial.worker.confidence_stop`) is at least the
threshold: ``n_b`` nodes in ``0..N`` (0: a plain decode through verify).

- **Ancestor-closed**: a child's cumulative log-probability is its parent's plus a
  non-positive term, so a kept node's parent is kept; the kept subtree is a tree.
- **Lossless**: which nodes are kept depends only on the drafter's distributions (the
  children are the deterministic top-k, never a draw), so greedy rows still emit the target's
  argmax, seeded rows their own coupled draws (keyed by position, not by the tree), and the
  recursive residual rule of unseeded rows over any fixed set of children emits ``p``
  (:mod:`specdial.worker.tree_accept`, ``kept``). The confidence stop's deviation for unseeded
  chains (``max_x q`` instead of ``q(d)``) is not needed: a tree's node tokens are not drawn.
- **Compute**: on a CPU device (no CUDA graphs; reading ``n_b`` there is no sync) the tree is
  compacted to ``N' = max_b n_b`` columns (:func:`compact_tree`) and the verify is ragged:
  request ``b`` puts only its root and its ``n_b`` kept nodes through the target, ``n_b + 1``
  tokens, not ``N' + 1`` (``tree_step._verify_ragged``; the attention's ragged tree rule,
  :mod:`specdial.attention.base`); its padded columns get no KV and logits 0, and are never
  accepted. On a CUDA device the verify keeps the plan's ``N`` (its ``(N, batch)`` graph key,
  no sync): the dropped nodes are only masked out of acceptance, as the chain's stop only
  shortens what acceptance reads on a GPU (ragged eager verifies there would need the kept
  counts on the host: a sync).

The kept counts ride in the iteration's one host copy and come back as the report's
``verified`` (the trace's ``verified`` beside ``tree_nodes``). So do the verified nodes' path
confidences, the accepted path's first (:func:`path_first_confidences`): the report's
``draft_probs`` of a tree, from which the core's confidence calibration (the one that prices
nodes for ``"auto"``) learns which nodes of each confidence were accepted.
"""

from __future__ import annotations

import dataclasses

import torch

from specdial.worker.tree import DraftTree
from specdial.worker.tree_draft import TreeDraft

__all__ = ["compact_tree", "kept_nodes", "path_first_confidences"]

I64 = torch.int64


def kept_nodes(confidence: torch.Tensor, min_survival: float) -> torch.Tensor:
    """``[B, N]`` bool: the nodes whose path confidence ``confidence`` ``[B, N]`` float (in
    ``[0, 1]``, :attr:`TreeDraft.confidence`) is ``>= min_survival``. Ancestor-closed for a
    tree from :func:`~specdial.worker.tree_draft.draft_tree` (module docstring). Raises
    ``ValueError`` for ``min_survival`` outside ``(0, 1)``."""
    if not 0.0 < min_survival < 1.0:
        raise ValueError(f"min_survival must be in (0, 1), got {min_survival}")
    return confidence >= min_survival


def compact_tree(td: TreeDraft, kept: torch.Tensor, width: int) -> tuple[TreeDraft, torch.Tensor]:
    """The tree of ``td`` with each request's kept nodes first, cut to ``width`` columns.

    ``kept`` ``[B, N]`` bool, ancestor-closed, at most ``width`` per row; ``width`` in ``1..N``.
    Returns ``(TreeDraft [B, width], kept [B, width] bool)``: row ``b``'s first ``n_b`` nodes
    are its kept ones in their order (depth, then decreasing score, so parents precede
    children and depths do not decrease); the rest are copies of its last kept node (or of node
    0 when none is kept: a depth-1 node) marked not kept, so acceptance never takes them.
    Parents are re-indexed; ``node_fed`` and ``confidence`` follow. Raises ``ValueError`` for a
    ``width`` outside ``1..N`` or a shape mismatch; no host sync.
    """
    tree = td.tree
    b, n = tree.tokens.shape
    if tuple(kept.shape) != (b, n):
        raise ValueError(f"compact_tree: kept must be [B={b}, N={n}], got {list(kept.shape)}")
    if not 1 <= width <= n:
        raise ValueError(f"compact_tree: width must be in 1..{n}, got {width}")
    dev = kept.device
    order = (~kept).to(torch.int8).argsort(dim=1, stable=True)  # kept first, in node order
    count = kept.sum(1, keepdim=True)
    col = torch.arange(width, device=dev)[None, :]
    take = order.gather(1, torch.minimum(col, (count - 1).clamp(min=0)))  # [B, width]
    new_index = torch.full((b, n), -1, dtype=I64, device=dev)
    new_index.scatter_(1, order[:, :width], col.expand(b, -1).contiguous())
    parent = tree.parents.gather(1, take)
    parent = torch.where(parent < 0, -1, new_index.gather(1, parent.clamp(min=0)))
    small = DraftTree(tree.tokens.gather(1, take), parent, tree.depths.gather(1, take),
                      tree.scores.gather(1, take), depth=tree.depth, topk=tree.topk)
    out = dataclasses.replace(td, tree=small, node_fed=td.node_fed.gather(1, take),
                              confidence=td.confidence.gather(1, take))
    return out, col < count


def path_first_confidences(td: TreeDraft, kept: torch.Tensor | None,
                           path: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` float32: each request's node path confidences (:attr:`TreeDraft.confidence`)
    reordered so the nodes on its accepted path come first (depth order: parents precede
    children), then its other kept nodes (node order), then the rest. ``kept`` ``[B, N]`` bool
    (None: every node is kept); ``path`` ``[B, D]`` int64: the accepted nodes' verify columns
    (node ``c - 1`` is column ``c``; ``-1`` past the path), as
    :func:`~specdial.worker.tree_accept.tree_accept` returns them (capped where the plan caps).
    The first ``verified[b]`` entries of row ``b`` are what the report's ``draft_probs`` carries
    for it, its first ``accepted[b]`` the accepted ones (``Scheduler.report``). No host sync."""
    b, n = td.confidence.shape
    on = torch.zeros(b, n + 1, dtype=torch.int8, device=path.device)
    on = on.scatter_(1, path.clamp(min=0), 1)[:, 1:].bool()  # column 0 (root) is the sink
    rank = torch.where(on, 0, 1) if kept is None else torch.where(on, 0, torch.where(kept, 1, 2))
    return td.confidence.gather(1, rank.argsort(dim=1, stable=True))

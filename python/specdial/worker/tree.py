"""Draft trees (issue 29): the EAGLE-2 node selection and the tree attention mask.

A draft tree of one request has a *root* (the last emitted token ``x_L``, position ``L``) and
``N`` nodes (SGLang's ``--speculative-num-draft-tokens`` without the root). Node ``i`` holds a
draft token, its parent (``-1`` = the root), its depth ``1..D`` (position ``L + depth``) and
its cumulative draft log-probability (sum of the drafter's log-probabilities along its path).

Dynamic trees follow EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees", arXiv 2406.16858, section 4): *expansion* keeps, at every level, the
``topk`` best nodes of the new level by cumulative log-probability as the frontier, each
frontier node gets its ``topk`` most likely children; *reranking* keeps the ``N`` best nodes of
all levels by cumulative log-probability. Because a child's cumulative log-probability is at
most its parent's, the best ``N`` are ancestor-closed; ties (a child with probability 1) are
broken towards the shallower node, so closure holds exactly (:func:`select_nodes`). SGLang's
``organize_draft_results`` / ``build_tree_kernel_efficient`` do the same selection.

Node order within a tree (:class:`DraftTree`): by depth, then by decreasing cumulative
log-probability, so a parent always precedes its children and the children of one parent are
in decreasing draft probability (the order :mod:`specdial.worker.tree_accept` tries them in).
Verify column ``c`` of a request is the root for ``c = 0`` and node ``c - 1`` otherwise.

Shapes: ``B`` requests, ``N`` nodes, ``K`` = topk, ``D`` = depth; tokens, parents and depths
int64, scores float32, everything on one device, no per-element Python (loops run over the
``D <= 7`` levels only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "TreeExpansion", "ancestor_mask", "build_tree", "expand_level", "select_nodes", "tree_positions"]

I64 = torch.int64


@dataclass
class DraftTree:
    """The selected draft tree of every request of a batch.

    - ``tokens`` ``[B, N]`` int64: node tokens (target vocabulary ids).
    - ``parents`` ``[B, N]`` int64: parent node index, ``-1`` for children of the root;
      ``parents[b, i] < i``.
    - ``depths`` ``[B, N]`` int64 in ``1..D``, non-decreasing along a row.
    - ``scores`` ``[B, N]`` float32: cumulative draft log-probability (non-increasing within
      one depth).
    - ``depth``: ``D``, the number of draft levels; ``topk``: ``K``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    depth: int
    topk: int

    @property
    def num_nodes(self) -> int:
        """``N``: nodes per request, the root excluded."""
        return self.tokens.shape[1]

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify columns ``[root, nodes]``: ``(parent column [B, N + 1] int64, the root's
        is -1; depth [B, N + 1] int64, the root's is 0)``."""
        b = self.tokens.shape[0]
        minus = torch.full((b, 1), -1, dtype=I64, device=self.tokens.device)
        pcol = torch.cat([minus, torch.where(self.parents < 0, 0, self.parents + 1)], 1)
        return pcol, torch.cat([torch.zeros_like(minus), self.depths], 1)


def expand_level(logprobs: torch.Tensor, parent_scores: torch.Tensor,
                 topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EAGLE-2 expansion: the ``topk`` children of each of ``F`` frontier nodes.

    ``logprobs`` ``[B, F, V]``: the drafter's log-probabilities at each frontier node (or its
    raw logits: they are normalized here);
    ``parent_scores`` ``[B, F]`` float32: their cumulative log-probabilities (zeros for the
    root). Returns ``(tokens [B, F * K] int64, scores [B, F * K] float32, parent [B, F * K]
    int64 = the frontier index 0..F-1)``, frontier-major, each parent's children in decreasing
    probability (distinct tokens). Raises ``ValueError`` if ``topk`` is not in ``1..V``.
    """
    b, f, v = logprobs.shape
    if not 1 <= topk <= v:
        raise ValueError(f"expand_level: topk must be in 1..{v} (the vocabulary), got {topk}")
    x = logprobs.float()
    top, tok = x.topk(topk, dim=-1)  # [B, F, K], sorted
    # normalized here: raw logits work too, with no [B, F, V] log-softmax written
    lp = top - torch.logsumexp(x, -1, keepdim=True)
    scores = parent_scores.float()[:, :, None] + lp
    parent = torch.arange(f, device=logprobs.device)[None, :, None].expand(b, f, topk)
    return tok.reshape(b, -1), scores.reshape(b, -1), parent.reshape(b, -1)


def select_nodes(scores: torch.Tensor, depths: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """EAGLE-2 reranking: indices ``[B, N]`` int64 of the ``N = num_nodes`` best candidates
    per row by ``scores`` ``[B, C]`` (cumulative log-probabilities), ties broken towards lower
    ``depths`` ``[B, C]`` and then lower index; returned sorted by (depth, score descending).

    Ancestor-closed whenever every candidate's score is ``<=`` its parent's and its depth
    ``>`` its parent's: a selected node's parent ranks before it. Raises ``ValueError`` if
    ``N`` is not in ``1..C``.
    """
    b, c = scores.shape
    if not 1 <= num_nodes <= c:
        raise ValueError(f"select_nodes: num_draft_tokens must be in 1..{c} (the candidates "
                         f"of this tree shape), got {num_nodes}")
    # stable sorts: by depth, then by score; equal scores keep the shallower node first
    by_depth = depths.argsort(dim=1, stable=True)
    s = scores.gather(1, by_depth)
    order = by_depth.gather(1, s.argsort(dim=1, descending=True, stable=True))
    best = order[:, :num_nodes]
    # the canonical node order: depth, then score descending (ties: candidate order)
    rank = torch.arange(num_nodes, device=scores.device)
    key = depths.gather(1, best) * num_nodes + rank  # best is score-descending: rank breaks ties
    return best.gather(1, key.argsort(dim=1))


def build_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
               depths: torch.Tensor, num_nodes: int, depth: int, topk: int) -> DraftTree:
    """The :class:`DraftTree` of the ``N = num_nodes`` best of ``C`` candidates.

    Candidates (``[B, C]`` each): ``tokens`` int64, ``scores`` float32 (cumulative draft
    log-probabilities), ``parents`` int64 (candidate index of the parent, ``-1`` = root,
    always an earlier level), ``depths`` int64 in ``1..depth``. Selection: :func:`select_nodes`;
    parents are re-indexed to node indices. Raises ``ValueError`` for ``N`` outside ``1..C``.
    """
    sel = select_nodes(scores, depths, num_nodes)
    b, c = tokens.shape
    inv = torch.full((b, c), -1, dtype=I64, device=tokens.device)
    inv.scatter_(1, sel, torch.arange(num_nodes, device=tokens.device).expand(b, -1))
    cand_parent = parents.gather(1, sel)
    node_parent = torch.where(cand_parent < 0, -1, inv.gather(1, cand_parent.clamp(min=0)))
    d = depths.gather(1, sel)
    return DraftTree(tokens.gather(1, sel), node_parent, d, scores.gather(1, sel).float(),
                     depth=depth, topk=topk)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N + 1, N + 1]`` bool over verify columns (root first): ``m[b, i, j]`` iff column
    ``j`` is column ``i`` or one of its ancestors (every column sees the root). ``parents``
    ``[B, N]`` int64 as in :class:`DraftTree` (``parents[b, i] < i``). Built by ``log2(N)``
    pointer-doubling steps of boolean matrix products, no per-node loop."""
    b, n = parents.shape
    dev = parents.device
    cols = n + 1
    pcol = torch.cat([torch.zeros(b, 1, dtype=I64, device=dev),
                      torch.where(parents < 0, 0, parents + 1)], 1)  # root's parent: itself
    eye = torch.eye(cols, dtype=torch.bool, device=dev).expand(b, cols, cols)
    up = torch.zeros(b, cols, cols, dtype=torch.float32, device=dev)
    up.scatter_(2, pcol[:, :, None], 1.0)  # one step up
    reach = eye.float() + up  # ancestors within 1 step
    hops = 1
    while hops < cols:
        reach = (torch.bmm(reach, reach) > 0).float()
        hops *= 2
    return reach > 0


def tree_positions(target_len: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, N + 1]`` int64 of the verify columns: the root at ``L``, a node of
    depth ``d`` at ``L + d`` (``target_len`` ``[B]`` int64, ``depths`` ``[B, N]``)."""
    root = torch.zeros_like(depths[:, :1])
    return target_len.to(I64)[:, None] + torch.cat([root, depths], 1)


class TreeExpansion:
    """EAGLE-2's level loop over candidates, fed one drafter output per level.

    :meth:`first` takes the drafter's log-probabilities at the root, :meth:`next` those at the
    current frontier (``K`` nodes, fed to the drafter at one position), and each returns the
    new frontier's tokens ``[B, K]`` (the next level's drafter input). After the ``D`` levels,
    :meth:`finish` reranks into a :class:`DraftTree`. ``frontier_parent`` ``[B, K]`` int64:
    the index, within the previous frontier, of each frontier node's parent (EAGLE feeds the
    parent's drafter output with the child's token); ``frontier_mask`` ``[B, K, K * (l - 1)]``
    bool at level ``l``: which of the frontiers fed before (levels ``1 .. l - 1``, in feeding
    order) hold the frontier node's ancestors; :meth:`feed_mask` adds the node itself (the
    drafter's tree mask over its scratch keys; the prefix and the root are visible to all). Raises ``ValueError`` for
    ``topk`` or ``depth`` below 1.
    """

    def __init__(self, topk: int, depth: int) -> None:
        if topk < 1 or depth < 1:
            raise ValueError(f"draft tree: topk and depth must be >= 1, got {topk}, {depth}")
        self.topk, self.depth, self.level = topk, depth, 0
        self._cand: list[tuple[torch.Tensor, ...]] = []  # (tokens, scores, parents, depths)
        self._count = 0
        #: candidate indices of the frontiers fed so far, ``[B, K]`` per level (feeding order)
        self.fed: list[torch.Tensor] = []

    def _add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> None:
        self.level += 1
        self._cand.append((tokens, scores, parents, torch.full_like(tokens, self.level)))
        self._count += tokens.shape[1]

    def _frontier(self, tokens: torch.Tensor, scores: torch.Tensor, offset: int) -> torch.Tensor:
        best = scores.topk(self.topk, dim=1).indices  # [B, K]
        self.frontier_cand = offset + best
        self.frontier_scores = scores.gather(1, best)
        return tokens.gather(1, best)

    def first(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Level 1 from the root's ``[B, V]`` log-probabilities; returns its ``K`` tokens."""
        b = logprobs.shape[0]
        zeros = torch.zeros(b, 1, dtype=torch.float32, device=logprobs.device)
        tokens, scores, _ = expand_level(logprobs[:, None], zeros, self.topk)
        self._add(tokens, scores, torch.full_like(tokens, -1))
        self.frontier_cand = torch.arange(self.topk, device=tokens.device).expand(b, -1)
        self.frontier_scores = scores
        self.frontier_parent = torch.zeros_like(tokens)
        self.frontier_mask = torch.zeros(b, self.topk, 0, dtype=torch.bool, device=tokens.device)
        return tokens

    def next(self, logprobs: torch.Tensor) -> torch.Tensor:
        """The next level from the frontier's ``[B, K, V]`` log-probabilities."""
        if not 1 <= self.level < self.depth:
            raise ValueError(f"draft tree: level {self.level + 1} outside 2..{self.depth}")
        self.fed.append(self.frontier_cand)
        tokens, scores, parent = expand_level(logprobs, self.frontier_scores, self.topk)
        offset = self._count
        self._add(tokens, scores, self.frontier_cand.gather(1, parent))
        b, k = self.frontier_cand.shape
        old_mask = self.feed_mask()  # the previous frontier: itself + ancestors
        frontier = self._frontier(tokens, scores, offset)
        self.frontier_parent = parent.gather(1, self.frontier_cand - offset)
        self.frontier_mask = old_mask.gather(
            1, self.frontier_parent[:, :, None].expand(b, k, old_mask.shape[2]))
        return frontier

    def feed_mask(self) -> torch.Tensor:
        """``[B, K, K * level]`` bool: the drafter's tree mask when the current frontier is
        fed (keys: the fed frontiers of levels ``1 .. level`` in order, the current one last;
        each node sees itself and its ancestors)."""
        b, k = self.frontier_cand.shape
        eye = torch.eye(k, dtype=torch.bool, device=self.frontier_cand.device).expand(b, k, k)
        return torch.cat([self.frontier_mask, eye], 2)

    def finish(self, num_nodes: int) -> tuple[DraftTree, torch.Tensor]:
        """The reranked tree of ``num_nodes`` nodes and each node's candidate index ``[B, N]``
        (candidates are numbered level by level: level 1's ``K``, then ``K * K`` per level).
        Raises ``ValueError`` before the last level or for ``N`` outside the candidates."""
        if self.level != self.depth:
            raise ValueError(f"draft tree: finish after level {self.level} of {self.depth}")
        tokens, scores, parents, depths = (torch.cat(t, 1) for t in zip(*self._cand))
        sel = select_nodes(scores, depths, num_nodes)
        return build_tree(tokens, scores, parents, depths, num_nodes, self.depth,
                          self.topk), sel

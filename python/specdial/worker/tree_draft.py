"""EAGLE-2 dynamic-tree drafting with any :class:`~specdial.worker.drafters.Drafter` (issue 29).

One drafter forward per level (Li et al. 2024, EAGLE-2, section 4; SGLang's
``EagleDraftWorker.draft_forward`` with ``topk > 1``):

- level 1: the root ``x_L`` at position ``L`` (its chain slot, the prefix before it: a plain
  causal step, exactly a chain's first draft step); its ``K`` most likely tokens are level 1;
- level ``l = 2 .. D``: the ``K`` frontier nodes of level ``l - 1`` are fed at position
  ``L + l - 1``, each attending to the prefix ``0 .. L`` and to its own ancestors among the
  nodes fed before (a tree mask, :meth:`~specdial.worker.tree.TreeExpansion.feed_mask`); their
  drafter KV goes to the *draft slots* ``draft_loc`` (``K`` per level, request-major); EAGLE
  heads read, for a node, the drafter output of its parent (the chain rule, per path).

Expansion and reranking: :class:`~specdial.worker.tree.TreeExpansion` over the drafter's
log-probabilities in the target vocabulary (``Drafter.to_target_logits``: EAGLE-3's reduced
vocabulary is ``-inf`` elsewhere), so tree tokens are target ids. The tree's tokens are chosen
deterministically (top-k), whatever the sampling options: :mod:`specdial.worker.tree_accept`
keeps sampling lossless with that. Eager only (no CUDA graph yet). No host sync beyond the
attention plans, except under a grammar (structured outputs): then each level's drafter logits
are masked per frontier node (:mod:`specdial.worker.grammar_tree`, one sync per level).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdial.models.batch import ForwardBatch
from specdial.worker.runtime import RequestTables
from specdial.worker.tree import DraftTree, TreeExpansion
from specdial.worker.tree_kv import tree_kv_indices

__all__ = ["TreeDraft", "draft_tree"]


@dataclass
class TreeDraft:
    """A drafted tree and where its drafter KV lives.

    - ``tree``: the reranked :class:`~specdial.worker.tree.DraftTree` (``[B, N]``).
    - ``node_fed`` ``[B, N]`` int64: the draft slot holding each node's drafter KV (it was
      fed as a frontier node), ``-1`` for nodes never fed (leaves of the drafting).
    - ``confidence`` ``[B, N]`` float32: ``exp`` of each node's cumulative draft
      log-probability (the drafter's probability of its whole path).
    """

    tree: DraftTree
    node_fed: torch.Tensor
    confidence: torch.Tensor


def draft_tree(drafter: Any, backend: Any, tables: RequestTables, rows: torch.Tensor,
               target_len: np.ndarray, root_ids: torch.Tensor, first_hidden: torch.Tensor | None,
               draft_loc: torch.Tensor, *, topk: int, depth: int, num_nodes: int,
               grammar: Any = None, rows_host: np.ndarray | None = None) -> TreeDraft:
    """Draft one EAGLE-2 tree per request (see the module docstring).

    - ``drafter``: a :class:`~specdial.worker.drafters.Drafter` whose KV is valid for
      positions ``0 .. L - 1`` (``draft_len == L``: the caller catches up first);
      ``backend``: the attention backend; ``tables``: the chain slots (position ``L``'s too).
    - ``rows`` ``[B]`` device int64; ``target_len`` host int64 ``[B]`` (``L``);
      ``root_ids`` ``[B]`` int64 (``x_L``); ``first_hidden`` ``[B, F]`` (EAGLE's
      ``h_{L-1}``) or None.
    - ``draft_loc`` ``[B, K * (D - 1)]`` int64: drafter KV slots of the fed frontier nodes,
      level ``l``'s ``K`` at columns ``K * (l - 2) ..``; none of them a chain slot in use.
    - ``grammar``: a :class:`~specdial.worker.grammar_tree.TreeGrammar` when some row is
      constrained (structured outputs): each level's drafter logits are masked with each
      frontier node's path state before the top-k; None: no masks.
    - ``rows_host``: ``rows`` as a host int64 array (the plan's), so the key lists are built
      on the host without reading ``rows`` back from the device; None reads it back.

    Raises ``ValueError`` for a ``draft_loc`` of the wrong shape or a shape that
    :class:`TreeExpansion` / :func:`~specdial.worker.tree.select_nodes` refuses.
    """
    b = rows.numel()
    dev = root_ids.device
    if tuple(draft_loc.shape) != (b, topk * (depth - 1)):
        raise ValueError(f"draft_tree: draft_loc must be [B={b}, topk*(depth-1)="
                         f"{topk * (depth - 1)}], got {list(draft_loc.shape)}")
    exp = TreeExpansion(topk, depth)
    lens = torch.from_numpy(np.ascontiguousarray(target_len, np.int64)).to(dev)
    # level 1: x_L at L, causal over 0..L (a chain's first draft step)
    root_loc = tables.req_to_token[rows, lens]
    key_rows = rows if rows_host is None else rows_host
    kv_idx, kv_lens = tree_kv_indices(tables, key_rows, target_len, root_loc[:, None])
    ones = torch.ones(b, dtype=torch.int64)  # host lengths: planning never waits
    batch = ForwardBatch(root_ids, lens, root_loc, backend.plan(ones, kv_lens, kv_idx))
    h = drafter.extend(batch, backend, hidden_states=first_hidden, kv_only=False)
    logits = _logprobs(drafter, h)
    front = exp.first(logits if grammar is None else grammar.mask_root(logits))
    for level in range(2, depth + 1):
        if grammar is not None:  # the frontier's paths go to the host during the forward
            grammar.start_level(front, exp.frontier_parent)
        fed = draft_loc[:, : topk * (level - 1)]
        loc = fed[:, -topk:]
        kv_idx, kv_lens = tree_kv_indices(tables, key_rows, target_len + 1, fed)
        qo = torch.full((b,), topk, dtype=torch.int64)
        meta = backend.plan(qo, kv_lens, kv_idx, tree_mask=exp.feed_mask())
        pos = (lens + level - 1)[:, None].expand(b, topk)
        batch = ForwardBatch(front.reshape(-1), pos.reshape(-1), loc.reshape(-1), meta)
        hidden = None
        if h is not None and drafter.needs_target_hidden:
            hp = h.view(b, -1, h.shape[-1])  # the previous level's outputs, per frontier node
            hidden = hp.gather(1, exp.frontier_parent[:, :, None].expand(b, topk, hp.shape[-1]))
            hidden = hidden.reshape(b * topk, -1)
        h = drafter.extend(batch, backend, hidden_states=hidden, kv_only=False)
        logits = _logprobs(drafter, h).view(b, topk, -1)
        front = exp.next(logits if grammar is None else grammar.mask_level(logits))
    tree, sel = exp.finish(num_nodes)
    return TreeDraft(tree, _fed_slots(exp, sel, draft_loc), tree.scores.exp())


def _logprobs(drafter: Any, h: torch.Tensor) -> torch.Tensor:
    """The drafter's logits over the target vocabulary ``[T, V]`` (``-inf`` outside an
    EAGLE-3 draft vocabulary); :func:`~specdial.worker.tree.expand_level` normalizes them."""
    return drafter.to_target_logits(drafter.compute_logits(h))


def _fed_slots(exp: TreeExpansion, sel: torch.Tensor, draft_loc: torch.Tensor) -> torch.Tensor:
    """Draft slot ``[B, N]`` of each selected candidate ``sel`` that was fed as a frontier
    node (``exp.fed``, in ``draft_loc``'s column order), else ``-1``."""
    if not exp.fed:
        return torch.full_like(sel, -1)
    fed = torch.cat(exp.fed, 1)  # [B, K * (D - 1)]
    match = sel[:, :, None] == fed[:, None, :]
    col = match.to(torch.int8).argmax(-1)
    return torch.where(match.any(-1), draft_loc.gather(1, col), -1)

"""The worker's draft-tree iteration (issue 29): draft a tree, verify it, accept, copy, extend.

:func:`run_tree_iteration` runs one decode plan whose ``tree_topk > 1`` on a
:class:`~specdial.worker.worker.SpecWorker` (the draft levels eager; the verify replays a
``(N, batch)`` graph where the worker captured one, :mod:`specdial.worker.tree_graphs`). The plan's contract (shared with the Rust scheduler's side, issue 29):

- ``steps = D`` (the tree's depth), ``tree_topk = K``, ``num_draft_tokens = N``;
- ``out_loc`` ``[B * (D + 1)]``: chain slots of positions ``L .. L + D`` (request-major);
- ``scratch_loc`` ``[B * S]``, ``S = max(N, K * (D - 1))`` (the core's
  ``scratch_per_request``): scratch slots, freed by the core when the report comes in; the
  tree's nodes (target KV, EAGLE features) use the first ``N`` of each request's, the
  drafter's fed frontier nodes (``K`` per level ``2 .. D``) the first ``K * (D - 1)`` in the
  drafter's own pool (or ``draft_loc`` ``[B * K * (D - 1)]`` when a plan carries one, with
  ``S = N``);
- ``rows``, ``input_ids`` (``x_L``), ``positions`` (``L``) as for a chain.

Steps: the drafter's catch-up to ``L``; :func:`~specdial.worker.tree_draft.draft_tree`; one
target forward over ``[x_L, nodes]`` at positions ``L, L + depth`` with the tree mask
(:func:`~specdial.worker.tree.ancestor_mask`), node KV into the scratch slots;
:func:`~specdial.worker.tree_accept.tree_accept`; the accepted path's target KV, EAGLE
features and (draft model) drafter KV copied into the chain slots of ``L + 1 .. L + a``
(:mod:`specdial.worker.tree_kv`); then the report is a chain's (``accepted[b] = a <= D``,
``a + 1`` tokens) and the draft extend covers the accepted path only (invariant 3). The
iteration's one host copy carries the accepted counts, the emitted tokens and the fed-path
lengths. Penalties, ``min_tokens`` and ``logit_bias`` process each verify column with its own
path (:mod:`specdial.worker.tree_processing`); log-probabilities are the raw target logits of
the columns that decided the emitted tokens (the root, then the accepted path), as for a chain.
Structured outputs (issue 31): with constrained rows (``sampling.grammar``) the drafts of every
level and the verify columns are masked with each node's path state
(:mod:`specdial.worker.grammar_tree`), the logprobs of those rows are the masked
distribution's, and the emitted tokens advance the matchers once after the host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdial.models.batch import ForwardBatch
from specdial.worker.batch_sampling import BatchSampling
from specdial.worker.drafters import run_target
from specdial.worker.grammar_tree import TreeGrammar
from specdial.worker.logprobs import LogprobRows, token_logprobs
from specdial.worker.stages import StepOutput
from specdial.worker.tree import ancestor_mask, tree_positions
from specdial.worker.tree_accept import path_columns, tree_accept
from specdial.worker.tree_budget import compact_tree, kept_nodes, path_first_confidences
from specdial.worker.tree_draft import TreeDraft, draft_tree
from specdial.worker.tree_kv import copy_rows, copy_slots, tree_kv_indices
from specdial.worker.tree_processing import process_tree_columns, step_histories

__all__ = ["TreePlan", "is_tree_plan", "run_tree_iteration"]


@dataclass
class TreePlan:
    """A tree decode plan's fields (host int64 arrays; see the module docstring). Raises
    ``ValueError`` naming the field whose size does not fit."""

    rows: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_loc: np.ndarray
    scratch_loc: np.ndarray
    steps: int
    tree_topk: int
    num_draft_tokens: int
    draft_loc: np.ndarray | None = None
    #: ``[B]`` int64, each ``<= steps``: a request the core capped near its end
    #: (``max_new_tokens``, the context) accepts at most this many drafts; ``out_loc`` then
    #: holds ``sum(steps_per_request + 1)`` chain slots. None: every request ``steps``.
    steps_per_request: np.ndarray | None = None
    #: per-request node budgets (issue 29 item 5, :mod:`specdial.worker.tree_budget`): a
    #: request verifies only the nodes whose path confidence is ``>= min_survival``; 0: all N
    min_survival: float = 0.0

    def __post_init__(self) -> None:
        b, d, k, n = len(self.rows), self.steps, self.tree_topk, self.num_draft_tokens
        if not 0.0 <= self.min_survival < 1.0:
            raise ValueError(f"tree plan: min_survival must be in [0, 1) (0: every node "
                             f"verified), got {self.min_survival}")
        spr = self.steps_per_request
        if spr is not None and (len(spr) != b or (b and (spr.min() < 0 or spr.max() > d))):
            raise ValueError(f"tree plan: steps_per_request must hold {b} values in 0..{d}, "
                             f"got {np.asarray(spr).tolist()}")
        if d < 1 or k < 1 or not d <= n <= 64:
            raise ValueError(f"tree plan: steps (depth) >= 1, tree_topk >= 1 and steps <= "
                             f"num_draft_tokens <= 64 required, got {d}, {k}, {n}")
        width = n if self.draft_loc is not None else max(n, k * (d - 1))
        chain = b * (d + 1) if spr is None else int((spr + 1).sum())
        for name, size in (("input_ids", b), ("positions", b), ("out_loc", chain),
                           ("scratch_loc", b * width)):
            if len(getattr(self, name)) != size:
                raise ValueError(f"tree plan: {name} has {len(getattr(self, name))} entries, "
                                 f"expected {size}")
        cands = k + (d - 1) * k * k
        if n > cands:
            raise ValueError(f"tree plan: num_draft_tokens {n} above the {cands} nodes a tree "
                             f"of tree_topk {k} and depth {d} can hold (topk + (depth - 1) * "
                             "topk**2)")
        need = b * k * (d - 1)
        if self.draft_loc is not None and len(self.draft_loc) != need:
            raise ValueError(f"tree plan: draft_loc has {len(self.draft_loc)} entries, "
                             f"expected {need}")


    @classmethod
    def from_plan(cls, plan: Any) -> "TreePlan":
        """The fields of a scheduler plan with ``tree_topk > 1`` (issue 29's contract:
        ``steps``, ``tree_topk``, ``num_draft_tokens``, ``scratch_loc``, ``out_loc``, and
        ``draft_loc`` when the plan has one)."""
        def i64(x: Any) -> np.ndarray:  # a writable copy (the plan's arrays are read-only)
            return np.array(x, np.int64)

        draft = getattr(plan, "draft_loc", None)
        spr = getattr(plan, "steps_per_request", None)
        return cls(i64(plan.rows), i64(plan.input_ids), i64(plan.positions), i64(plan.out_loc),
                   i64(plan.scratch_loc), int(plan.steps), int(plan.tree_topk),
                   int(plan.num_draft_tokens), None if draft is None else i64(draft),
                   None if spr is None else i64(spr),
                   float(getattr(plan, "min_survival", 0.0) or 0.0))


def is_tree_plan(plan: Any) -> bool:
    """Whether a decode plan runs the tree iteration: a :class:`TreePlan`, or a plan with
    ``tree_topk > 1`` (a chain's plans have ``tree_topk`` 1 or no such field, and keep the
    chain path unchanged)."""
    return isinstance(plan, TreePlan) or int(getattr(plan, "tree_topk", 1) or 1) > 1


def run_tree_iteration(worker: Any, plan: TreePlan, sampling: BatchSampling,
                       generator: torch.Generator | None,
                       logprobs: LogprobRows | None = None) -> StepOutput:
    """One tree iteration on ``worker`` (a :class:`~specdial.worker.worker.SpecWorker` with a
    drafter) for ``plan``; returns the chain-shaped :class:`StepOutput` (``logprobs``: as
    :meth:`SpecWorker.decode <specdial.worker.worker.SpecWorker.decode>`'s). Raises
    ``ValueError`` without a drafter."""
    ds, drafter = worker.drafter_state, worker.drafter
    if ds is None or drafter is None:
        raise ValueError("a draft tree needs a drafter")
    b, d, k, n = len(plan.rows), plan.steps, plan.tree_topk, plan.num_draft_tokens
    dev, tables = worker.device, worker.tables
    if d > drafter.max_steps or (b and int((plan.positions + d + 1).max()) >= tables.width):
        raise ValueError(f"tree plan: depth {d} above the drafter's max_steps "
                         f"{drafter.max_steps} or past the request tables' {tables.width} "
                         "positions")
    rows, lens = plan.rows, plan.positions
    if len(rows) and (rows.min() < 0 or rows.max() >= worker.max_bs):
        raise ValueError(f"tree plan: rows {rows.tolist()} outside 0..{worker.max_bs - 1}")
    limit = np.full(b, d, np.int64) if plan.steps_per_request is None else plan.steps_per_request
    tables.write(rows, lens, limit + 1, kv_slots=plan.out_loc)
    tables.write(rows, lens, np.ones(b, np.int64), ids=plan.input_ids)
    runner = worker.states[min(worker.states)]
    ds.catch_up(rows, lens, runner)
    rows_d = torch.from_numpy(rows).to(dev)
    lens_d = torch.from_numpy(lens).to(dev)
    root = torch.from_numpy(plan.input_ids).to(dev)
    chain = _padded_chain(plan.out_loc, limit, d, worker.pad_kv_slot).to(dev)
    scratch_all = torch.from_numpy(plan.scratch_loc).to(dev).view(b, -1)
    scratch = scratch_all[:, :n]
    draft_loc = (scratch_all[:, : k * (d - 1)] if plan.draft_loc is None
                 else torch.from_numpy(plan.draft_loc).to(dev).view(b, -1))
    first_hidden = None
    if ds.features is not None:
        first_hidden = ds.features[tables.req_to_token[rows_d, (lens_d - 1).clamp(min=0)]]
        first_hidden = torch.where((lens_d > 0)[:, None], first_hidden, 0)
    tg = None if sampling.grammar is None else TreeGrammar(sampling.grammar)
    try:
        td = draft_tree(drafter, worker.backend, tables, rows_d, lens, root, first_hidden,
                        draft_loc, topk=k, depth=d, num_nodes=n, grammar=tg, rows_host=rows)
        td, kept, n_kept = _node_budget(worker, td, plan.min_survival)
        scratch = scratch[:, : td.tree.num_nodes]
        if tg is not None:  # the tree goes to the host during the target's forward
            tg.start_verify(td.tree)
        ancestors = ancestor_mask(td.tree.parents)  # [B, N + 1, N + 1]: verify and acceptance
        # ragged on the compacted CPU path: request b puts its n_b + 1 columns through the
        # target, not the batch's widest (n_kept is host memory there: no sync)
        ragged = n_kept.numpy() if kept is not None and _compacts(worker) else None
        raw = _verify(worker, td, rows, lens, root, chain[:, 0], scratch, ancestors, ragged)
        acc, path, out, lp_pending = _accept(worker, td, raw, rows, lens, root, sampling,
                                             generator, logprobs, tg, ancestors, kept)
    finally:
        if tg is not None:
            tg.reset()  # the matchers at their requests' states, even after a failure
    if plan.steps_per_request is not None:  # cap: the emitted prefix of a lossless draw
        cap = torch.from_numpy(limit).to(dev)
        acc = torch.minimum(acc, cap)
        path = torch.where(torch.arange(d, device=dev)[None, :] < cap[:, None], path, -1)
    fed = _copy_path(worker, td, path, chain[:, 1:], scratch)
    tables.req_to_ids[rows_d[:, None], lens_d[:, None] + 1 + torch.arange(d + 1, device=dev)] \
        = out
    conf = path_first_confidences(td, kept, path).to(torch.float64).view(torch.int64)
    host = torch.cat([acc[:, None], fed[:, None], n_kept[:, None], out, conf], 1)
    host = host.cpu().numpy()  # the one sync (the confidences ride bit for bit as int64)
    lp_host = None if lp_pending is None else lp_pending()
    accepted, fed_h = host[:, 0].astype(np.int64), host[:, 1].astype(np.int64)
    verified = None if kept is None else host[:, 2].astype(np.int64)
    out_h = host[:, 3:4 + d]
    node_probs = _host_node_probs(host, d)
    if sampling.grammar is not None:  # the emitted tokens advance the matchers once
        sampling.grammar.advance(accepted + 1, out_h)
    ds.after_verify(rows, lens, fed_h + 1, accepted)
    ds.catch_up(rows, lens + accepted + 1, runner)
    keep = np.arange(d + 1)[None, :] <= accepted[:, None]
    tokens = out_h[keep].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(accepted + 1)]).astype(np.int64)
    return StepOutput(d, tokens, offsets, accepted, lp_host, verified=verified,
                      draft_probs=node_probs)


def _node_budget(worker: Any, td: TreeDraft, min_survival: float
                 ) -> tuple[TreeDraft, torch.Tensor | None, torch.Tensor]:
    """Per-request node budgets (:mod:`specdial.worker.tree_budget`): ``(tree, kept [B, N']
    bool or None, kept counts [B] int64)``. Without a threshold every node is kept (``kept``
    None, counts ``N``); on a CPU device without tree graphs the tree is compacted to the
    batch's most kept nodes (at least 1 column), elsewhere only masked."""
    b, n = td.tree.tokens.shape
    if not min_survival:
        return td, None, torch.full((b,), n, dtype=torch.int64, device=td.tree.tokens.device)
    kept = kept_nodes(td.confidence, min_survival)
    count = kept.sum(1)
    if _compacts(worker):
        width = max(1, int(count.max())) if b else 1  # host memory: no sync
        td, kept = compact_tree(td, kept, width)
    return td, kept, count


def _host_node_probs(host: np.ndarray, d: int) -> np.ndarray:
    """The report's ``draft_probs`` of a tree from the iteration's host copy ``host`` (columns
    ``2``: verified nodes ``[B]``; ``4 + d ..``: :func:`path_first_confidences` as float64
    bits): per request its verified nodes' path confidences, the accepted path first, request
    after request, float64 ``[sum(verified)]``."""
    conf = np.ascontiguousarray(host[:, 4 + d:]).view(np.float64)
    return conf[np.arange(conf.shape[1])[None, :] < host[:, 2:3]]


def _compacts(worker: Any) -> bool:
    """Whether node budgets compact the tree and verify it ragged: a CPU device (the kept
    counts are host memory, no sync) without tree verify graphs (their key is the plan's N)."""
    return worker.device.type == "cpu" and getattr(worker, "tree_graphs", None) is None


def _accept(worker: Any, td: TreeDraft, raw: torch.Tensor, rows: np.ndarray, lens: np.ndarray,
            root: torch.Tensor, sampling: BatchSampling, generator: torch.Generator | None,
            logprobs: LogprobRows | None, grammar: TreeGrammar | None,
            ancestors: torch.Tensor, kept: torch.Tensor | None = None) -> tuple[Any, ...]:
    """Process the verify logits ``raw`` ``[B, N + 1, V]`` (each column with its own path:
    processors, then the grammar masks) and accept (:func:`tree_accept` over the tree mask
    ``ancestors`` ``[B, N + 1, N + 1]`` bool); returns
    ``(accepted [B], path [B, D], out [B, D + 1], logprobs' pending host copy or None)``. The
    logprobs are the raw target's at the deciding columns, grammar-masked for constrained
    rows (:meth:`~specdial.worker.grammar_tree.TreeGrammar.logprob_logits`)."""
    lens_d = torch.from_numpy(lens).to(raw.device)
    logits = raw
    if sampling.processors is not None:
        base, seen = step_histories(worker, sampling.processors, rows, lens)
        logits = process_tree_columns(raw, sampling.processors, td.tree, root, lens_d + 1,
                                      base, seen)
    if grammar is not None:
        logits = grammar.mask_verify(logits)
    acc, path, out = tree_accept(td.tree, logits, sampling, generator, lens_d + 1,
                                 ancestors=ancestors, kept=kept)
    lp_pending = None
    if logprobs is not None:
        cols = path_columns(path)  # the uncapped path: a cap keeps its prefix
        lp = raw.gather(1, cols[:, :, None].expand(-1, -1, raw.shape[2]))
        if grammar is not None:
            lp = grammar.logprob_logits(lp, cols)
        lp_pending = token_logprobs(lp, out, logprobs).to_host()
    return acc, path, out, lp_pending


def _padded_chain(out_loc: np.ndarray, limit: np.ndarray, d: int, pad: int) -> torch.Tensor:
    """``[B, D + 1]`` chain slots from the ragged ``out_loc`` (``limit[b] + 1`` slots of
    request ``b``), ``pad`` past each request's own: never written, since its accepted path
    is capped at ``limit[b]``."""
    b = len(limit)
    chain = np.full((b, d + 1), pad, np.int64)
    chain[np.arange(d + 1)[None, :] <= limit[:, None]] = out_loc
    return torch.from_numpy(chain)


def _verify(worker: Any, td: TreeDraft, rows: np.ndarray, lens: np.ndarray,
            root: torch.Tensor, root_loc: torch.Tensor, scratch: torch.Tensor,
            ancestors: torch.Tensor, ragged: np.ndarray | None = None) -> torch.Tensor:
    """The target over ``[x_L, nodes]`` with the tree mask ``ancestors`` (host ``rows``);
    logits ``[B, N + 1, V]``. ``ragged`` (host int64 ``[B]``, the compacted CPU path of a node
    budget): request ``b`` runs only the root and its first ``ragged[b]`` nodes (its kept
    ones), ``ragged[b] + 1`` tokens; the other columns' logits are 0 (never accepted)."""
    tree = td.tree
    b, n = tree.tokens.shape
    extra = torch.cat([root_loc[:, None], scratch], 1)  # [B, N + 1]
    pos = tree_positions(torch.from_numpy(lens).to(root.device), tree.depths)
    ids = torch.cat([root[:, None], tree.tokens], 1)
    graphs = getattr(worker, "tree_graphs", None)  # (N, batch) graphs: worker/tree_graphs.py
    key = None if graphs is None else graphs.serving_key(n, b)
    if key is not None:
        prefix, _ = tree_kv_indices(worker.tables, rows, lens, extra[:, :0])
        logits, feats = graphs.verify(key, ids, pos, extra, (prefix, lens), ancestors)
        worker.drafter_state.store_features(extra.reshape(-1), feats)
        return logits
    kv_idx, kv_lens = tree_kv_indices(worker.tables, rows, lens, extra)
    if ragged is not None:
        return _verify_ragged(worker, ids, pos, extra, kv_idx, kv_lens, lens, ancestors, ragged)
    qo = torch.full((b,), n + 1, dtype=torch.int64)  # host lengths, as tree_kv_indices's
    meta = worker.backend.plan(qo, kv_lens, kv_idx, tree_mask=ancestors)
    batch = ForwardBatch(ids.reshape(-1), pos.reshape(-1), extra.reshape(-1), meta)
    hidden, feats = run_target(worker.target, worker.drafter, batch, worker.kv, worker.backend)
    worker.drafter_state.store_features(batch.out_loc, feats)
    return worker.target.compute_logits(hidden).view(b, n + 1, -1)


def _verify_ragged(worker: Any, ids: torch.Tensor, pos: torch.Tensor, extra: torch.Tensor,
                   kv_idx: torch.Tensor, kv_lens: np.ndarray, lens: np.ndarray,
                   ancestors: torch.Tensor, kept: np.ndarray) -> torch.Tensor:
    """:func:`_verify` of a compacted tree (``ids`` / ``pos`` / ``extra`` ``[B, N' + 1]``)
    with request ``b``'s first ``kept[b] + 1`` columns packed (its kept nodes come first:
    :func:`~specdial.worker.tree_budget.compact_tree`); the attention's tree part of each
    request is its own columns (ragged rule, :mod:`specdial.attention.base`)."""
    b, t = ids.shape
    qo = kept.astype(np.int64) + 1
    sel_h = np.arange(t)[None, :] < qo[:, None]  # [B, N' + 1] host
    # keys: the prefix and each request's own columns only (drop the unverified ones' slots)
    full = np.asarray(kv_lens, np.int64)
    off = np.arange(int(full.sum())) - np.repeat(np.cumsum(full) - full, full)
    keys = np.nonzero(off < np.repeat(lens + qo, full))[0]
    kv_idx = kv_idx[torch.from_numpy(keys).to(kv_idx.device)]
    kv_lens = lens.astype(np.int64) + qo
    meta = worker.backend.plan(torch.from_numpy(qo), torch.from_numpy(kv_lens), kv_idx,
                               tree_mask=ancestors)
    sel = torch.from_numpy(sel_h).to(ids.device)
    batch = ForwardBatch(ids[sel], pos[sel], extra[sel], meta)
    hidden, feats = run_target(worker.target, worker.drafter, batch, worker.kv, worker.backend)
    worker.drafter_state.store_features(batch.out_loc, feats)
    packed = worker.target.compute_logits(hidden)  # [sum(kept + 1), V]
    logits = packed.new_zeros(b, t, packed.shape[-1])
    logits[sel] = packed
    return logits


def _copy_path(worker: Any, td: TreeDraft, path: torch.Tensor, dst: torch.Tensor,
               scratch: torch.Tensor) -> torch.Tensor:
    """The accepted path's target KV and EAGLE features (scratch slots) and the draft model's
    KV (draft slots of fed nodes) into the chain slots ``dst`` ``[B, D]`` of ``L + 1 ..``;
    returns the fed-path length ``[B]`` (leading accepted nodes with true drafter KV)."""
    valid = path >= 0
    node = (path - 1).clamp(min=0)
    src = scratch.gather(1, node)
    copy_slots(worker.kv, src, dst, valid)
    ds, drafter = worker.drafter_state, worker.drafter
    if ds.features is not None:
        copy_rows(ds.features, src, dst, valid, worker.num_kv_slots)
    if drafter.needs_target_hidden:  # EAGLE: nodes were fed approximate features
        return torch.zeros(path.shape[0], dtype=torch.int64, device=path.device)
    fed = td.node_fed.gather(1, node)
    ok = valid & (fed >= 0)
    copy_slots(drafter.kv, fed, dst, ok)
    return ok.to(torch.int64).cumprod(1).sum(1)

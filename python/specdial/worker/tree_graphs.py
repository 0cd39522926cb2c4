"""CUDA graphs of the draft-tree verify (issue 29): keyed ``(N, batch)``, per-request ``N``
padded to the captured ``N`` under the tree mask.

A tree iteration's target forward covers ``N + 1`` tokens per request (the root ``x_L`` and the
tree's ``N`` nodes) under the ancestor mask (:func:`~specdial.worker.tree.ancestor_mask`).
:class:`TreeVerifyGraphs` captures that forward, logits included, for each key ``(Nc, g)`` of
its plan and replays the smallest captured ``Nc >= N`` at the smallest captured ``g >= B``:

- **Padding N.** Columns ``N + 1 .. Nc`` of a real request are dummy nodes: a valid token id,
  position ``L + 1``, the pad KV slot as KV target and as key; in the mask they see the prefix
  and the root only, and no real column sees them, so the real columns' logits are those of the
  unpadded forward (attention over the same visible keys; the padded keys get weight 0).
  Padded requests (``B .. g``) read and write the pad slot only, as in the chain graphs
  (:mod:`specdial.worker.graph_passes`).
- **Which keys are captured** (:func:`tree_capture_plan`): ``Nc`` among the powers of two
  below the tree bound and the bound itself (every ``N`` the policy can choose pads to one of
  them: at most twice the tokens); batch sizes among the chain graphs' sizes, only those with
  ``g (Nc + 1) <= max(chain graph tokens)``, i.e. no tree graph has more tokens than the
  largest chain verify graph already captured (``max_graph_bs * (max_steps + 1)``): the shared
  graph pool's peak activation memory is not raised, and the static buffers (ids, positions,
  KV slots, the ``[g, 1, Nc + 1, kv_capacity]`` mask per ``Nc``) are bounded by the same
  token count. A batch above the largest such ``g``, a ``Nc`` not captured, or a backend whose
  static metadata takes no tree mask (flashinfer's static wrapper; its custom-mask path runs
  eagerly) runs the eager verify, counted in :attr:`TreeVerifyGraphs.stats`.
- **Draft graphs** per ``(depth, topk, batch)`` are not captured: the tree's draft levels run
  eagerly (:mod:`specdial.worker.tree_draft`).

Outputs of a replay are graph-pool tensors (valid until the next replay of the pool): the tree
iteration consumes them before any other pass runs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from specdial.attention.base import tree_key_mask
from specdial.attention.torch_backend import TorchAttentionBackend, TorchStaticAttention
from specdial.models.batch import ForwardBatch
from specdial.worker.drafters import run_target
from specdial.worker.graph_pool import CapturedGraph, GraphPool
from specdial.worker.step_buffers import RunnerStats

I64 = torch.int64

__all__ = ["TreeCapturePlan", "TreeVerifyGraphs", "capture_tree_graphs", "tree_capture_plan",
           "tree_node_counts"]


def tree_node_counts(max_num_draft_tokens: int) -> tuple[int, ...]:
    """Captured node counts ``Nc`` for trees of at most ``max_num_draft_tokens`` nodes (root
    excluded): the powers of two below the bound, and the bound (ascending). Raises
    ``ValueError`` for a bound outside ``2..64`` (the shared contract's ``N``)."""
    if not 2 <= max_num_draft_tokens <= 64:
        raise ValueError(f"max_num_draft_tokens must be in 2..64, got {max_num_draft_tokens}")
    out = [1 << p for p in range(1, 7) if (1 << p) < max_num_draft_tokens]
    return tuple(out + [max_num_draft_tokens])


@dataclass(frozen=True)
class TreeCapturePlan:
    """Which tree verify graphs to capture: ``{Nc: (g, ...)}`` batch sizes descending."""

    sizes: dict[int, tuple[int, ...]]

    def order(self) -> list[tuple[int, int]]:
        """Every ``(Nc, g)`` key, most tokens first (later graphs reuse the pool's blocks)."""
        keys = [(n, g) for n, gs in self.sizes.items() for g in gs]
        return sorted(keys, key=lambda k: (-k[1] * (k[0] + 1), -k[0]))

    @property
    def num_graphs(self) -> int:
        return sum(len(g) for g in self.sizes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"tree_verify": {str(n): list(g) for n, g in sorted(self.sizes.items())},
                "num_graphs": self.num_graphs}


def tree_capture_plan(max_num_draft_tokens: int, graph_bs: Iterable[int],
                      max_steps: int) -> TreeCapturePlan:
    """The ``(Nc, g)`` keys (module docstring): ``Nc`` in :func:`tree_node_counts`, ``g``
    among ``graph_bs`` with ``g (Nc + 1) <= max(graph_bs) (max_steps + 1)``. Raises
    ``ValueError`` for an empty ``graph_bs`` or a bad bound."""
    sizes = sorted(set(int(g) for g in graph_bs))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"graph batch sizes must be >= 1, got {sizes}")
    budget = sizes[-1] * (max_steps + 1)
    plan = {n: tuple(g for g in reversed(sizes) if g * (n + 1) <= budget)
            for n in tree_node_counts(max_num_draft_tokens)}
    return TreeCapturePlan({n: g for n, g in plan.items() if g})


@dataclass
class _Static:
    """The static inputs of one captured ``Nc``: ``[max_g * (Nc + 1)]`` ids, positions and KV
    slots, the attention metadata (``Nc + 1`` queries per request)."""

    ids: torch.Tensor
    pos: torch.Tensor
    loc: torch.Tensor
    attn: TorchStaticAttention
    metas: dict[int, Any] = field(default_factory=dict)


class TreeVerifyGraphs:
    """Captured tree verify forwards (module docstring).

    - ``target``, ``drafter`` (its ``run_target`` gives the EAGLE features), ``kv`` (the
      target's :class:`~specdial.kv_pool.KVPool`), ``backend``: as the worker's.
    - ``plan``: a :class:`TreeCapturePlan`; ``pool``: the engine's :class:`GraphPool`;
      ``kv_capacity``: most keys of one request (prefix, root and ``Nc`` nodes);
      ``dummy_token_id``: token of padded nodes and requests.

    :attr:`supported` is False for a backend without tree-mask static metadata (nothing is
    captured; :meth:`serving_key` always answers None). :attr:`enabled` False runs every tree
    verify eagerly (``disable_cuda_graph`` comparisons).
    """

    def __init__(self, *, target: Any, drafter: Any, kv: Any, backend: Any,
                 plan: TreeCapturePlan, pool: GraphPool, kv_capacity: int,
                 dummy_token_id: int = 0) -> None:
        self.target, self.drafter, self.kv, self.backend = target, drafter, kv, backend
        self.plan, self.pool, self.kv_capacity = plan, pool, kv_capacity
        self.dummy_token_id, self.pad_kv_slot = dummy_token_id, kv.pad_slot
        self.device = pool.device
        self.supported = isinstance(backend, TorchAttentionBackend)
        self.enabled = self.supported
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        #: replays (``tree_verify``) and eager fallbacks (``tree_verify:<reason>``)
        self.stats = RunnerStats()
        self._static: dict[int, _Static] = {}
        if self.supported:
            for n, gs in plan.sizes.items():
                m = max(gs) * (n + 1)
                self._static[n] = _Static(
                    torch.zeros(m, dtype=I64, device=self.device),
                    torch.zeros(m, dtype=I64, device=self.device),
                    torch.full((m,), self.pad_kv_slot, dtype=I64, device=self.device),
                    TorchStaticAttention(max(gs), n + 1, kv_capacity, self.device))

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every key of the plan (most tokens first); returns the graphs captured."""
        if not self.supported:
            return 0
        for n, g in self.plan.order():
            if (n, g) in self.graphs:
                continue
            self._fill(n, g, None)
            self.graphs[(n, g)] = self.pool.capture(self._body(n, g))
        return len(self.graphs)

    def _body(self, n: int, g: int) -> Callable[[], Any]:
        s, m = self._static[n], g * (n + 1)
        batch = ForwardBatch(s.ids[:m], s.pos[:m], s.loc[:m], s.metas[g])

        def body() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, feats = run_target(self.target, self.drafter, batch, self.kv, self.backend)
            return self.target.compute_logits(hidden), feats

        return body

    # ------------------------------------------------------------------ replay
    def serving_key(self, n: int, b: int) -> tuple[int, int] | None:
        """The captured ``(Nc, g)`` serving ``b`` requests of ``n`` nodes, or None (eager;
        the reason counted in :attr:`stats`)."""
        if not self.enabled:
            self.stats.fallback("tree_verify:disabled" if self.supported
                                else "tree_verify:backend_without_tree_graphs")
            return None
        counts = sorted(self.plan.sizes)
        i = bisect.bisect_left(counts, n)
        if i == len(counts):
            self.stats.fallback("tree_verify:nodes_not_captured")
            return None
        nc = counts[i]
        gs = sorted(self.plan.sizes[nc])
        j = bisect.bisect_left(gs, b)
        if j == len(gs):
            self.stats.fallback("tree_verify:batch_not_captured")
            return None
        return nc, gs[j]

    @torch.inference_mode()
    def verify(self, key: tuple[int, int], ids: torch.Tensor, pos: torch.Tensor,
               extra: torch.Tensor, prefix_kv: tuple[torch.Tensor, np.ndarray],
               tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay ``key`` (:meth:`serving_key`) for ``B`` requests of ``N`` nodes.

        ``ids``, ``pos``, ``extra`` ``[B, N + 1]`` int64: tokens, positions and KV slots of the
        root and the nodes; ``prefix_kv``: ``(flat slots [sum(L)], L [B] host)``, the chain
        slots of positions ``0 .. L - 1`` per request; ``tree_mask`` ``[B, N + 1, N + 1]`` bool
        (:func:`~specdial.worker.tree.ancestor_mask`). Returns ``(logits [B, N + 1, V],
        features [B * (N + 1), F] or None)``, graph-pool views. Raises ``ValueError`` for a
        key not captured or inputs that do not fit it."""
        nc, g = key
        graph = self.graphs.get(key)
        b, n1 = ids.shape
        if graph is None or n1 > nc + 1 or b > g:
            raise ValueError(f"tree verify graph {key} not captured or too small for "
                             f"[{b}, {n1}] inputs")
        self._fill(nc, g, (ids, pos, extra, prefix_kv, tree_mask))
        logits, feats = graph.replay()
        self.stats.replays["tree_verify"] = self.stats.replays.get("tree_verify", 0) + 1
        logits = logits.view(g, nc + 1, -1)[:b, :n1]
        if feats is not None:
            feats = feats.view(g, nc + 1, -1)[:b, :n1].reshape(b * n1, -1)
        return logits, feats

    def _fill(self, nc: int, g: int, inputs: tuple | None) -> None:
        """Static inputs and metadata of ``g`` requests at ``Nc`` (``inputs`` None: all
        padding, for the capture)."""
        s, n1 = self._static[nc], nc + 1
        dev, pad = self.device, self.pad_kv_slot
        ids = s.ids[: g * n1].view(g, n1)
        pos = s.pos[: g * n1].view(g, n1)
        loc = s.loc[: g * n1].view(g, n1)
        ids.fill_(self.dummy_token_id)
        pos.fill_(0)
        loc.fill_(pad)
        b, lens = 0, np.zeros(0, np.int64)
        mask = torch.eye(n1, dtype=torch.bool, device=dev).repeat(g, 1, 1)
        mask[:, :, 0] = True  # every column sees the root (padding included)
        flat = torch.zeros(0, dtype=I64, device=dev)
        if inputs is not None:
            r_ids, r_pos, r_extra, (flat_prefix, lens), r_mask = inputs
            b, m1 = r_ids.shape
            ids[:b, :m1] = r_ids
            pos[:b, :m1] = r_pos
            pos[:b, m1:] = r_pos[:, :1] + 1
            loc[:b, :m1] = r_extra
            mask[:b, :m1, :m1] = r_mask
            # keys: the prefix, then the root's and the nodes' slots (padded nodes: pad slot)
            lens = np.asarray(lens, np.int64)
            flat = _prefix_then(flat_prefix, lens, loc[:b])
        kv_lens = np.full(g, n1, np.int64)
        kv_lens[:b] = lens + n1
        valid = np.zeros(g, np.int64)
        valid[:b] = lens + n1
        meta = s.attn.plan(g, flat, valid, kv_lens, valid, pad)
        s.attn.mask[:g, 0] = tree_key_mask(torch.from_numpy(np.full(g, n1, np.int64)),
                                           torch.from_numpy(kv_lens), mask, self.kv_capacity)
        s.metas[g] = meta


def capture_tree_graphs(worker: Any, max_num_draft_tokens: int | None,
                        max_steps: int) -> TreeVerifyGraphs | None:
    """Capture a :class:`~specdial.worker.worker.SpecWorker`'s draft-tree verify graphs for
    the tree bound ``max_num_draft_tokens`` (nodes, root excluded) beside its chain graphs, in
    their memory pool, pruned by :func:`tree_capture_plan` against the chain verify graphs of
    ``max_steps``; None (tree verifies run eagerly) without chain graphs, a drafter or a
    bound."""
    if worker.capture_plan is None or worker.drafter is None or not max_num_draft_tokens:
        return None
    graphs = TreeVerifyGraphs(
        target=worker.target, drafter=worker.drafter, kv=worker.kv, backend=worker.backend,
        pool=next(iter(worker.states.values())).pool,
        plan=tree_capture_plan(max_num_draft_tokens, worker.capture_plan.graph_bs, max_steps),
        kv_capacity=worker.tables.width + max_num_draft_tokens + 1)
    graphs.capture()
    return graphs


def _prefix_then(flat_prefix: torch.Tensor, lens: np.ndarray, extra: torch.Tensor
                 ) -> torch.Tensor:
    """``[sum(lens) + B * t]`` slots: request ``b``'s ``lens[b]`` prefix slots (from
    ``flat_prefix``, request after request), then its ``extra[b]`` (``[B, t]``)."""
    b, t = extra.shape
    dev = extra.device
    if b == 0:
        return torch.zeros(0, dtype=I64, device=dev)
    kv = torch.from_numpy(lens + t).to(dev)
    total = int(lens.sum()) + b * t
    req = torch.repeat_interleave(torch.arange(b, device=dev), kv, output_size=total)
    j = torch.arange(total, device=dev) - (torch.cumsum(kv, 0) - kv)[req]
    pre = torch.from_numpy(lens).to(dev)
    off = (torch.cumsum(pre, 0) - pre)[req]
    in_prefix = j < pre[req]
    src = flat_prefix[(off + j).clamp(max=max(flat_prefix.numel() - 1, 0))] \
        if flat_prefix.numel() else torch.zeros_like(j)
    tail = extra[req, (j - pre[req]).clamp(min=0, max=t - 1)]
    return torch.where(in_prefix, src, tail)

